"""vLLM's prefix-cache reset, with a step of ours before it.

vLLM resets its prefix cache only when no block is in use (``BlockPool.reset_prefix_cache``):
the blocks a connector keeps for a finished request (``delay_free``, until the worker reports
it in ``finished_sending``) make it fail. Its pause and sleep (``EngineCore._reset_caches``,
with ``reset_running_requests``) then raise, and ``reset_prefix_cache()`` returns False and
leaves vLLM's own cache as it was: right after ``LLM.generate`` returns, an in-process engine
still holds its last request's blocks for us. ``before_reset`` runs a callback (which gives
those blocks back) inside ``KVCacheManager.reset_prefix_cache``, the call
``Scheduler.reset_prefix_cache`` makes before it checks the blocks, and before it resets the
connector (``reset_connector``).

``release_blocks`` frees a finished request's blocks as vLLM's scheduler does when the worker
reports it; vLLM frees them again on that report, which finds nothing left
(``SingleTypeKVCacheManager.pop_blocks_for_free`` pops with a default).

Written against vLLM 0.32 and 0.33 (``Scheduler.reset_prefix_cache``,
``KVCacheManager.reset_prefix_cache`` and ``KVCacheManager.free`` are the same in both).
"""

from __future__ import annotations

from typing import Callable


def before_reset(kv_cache_manager, callback: Callable[[], None]) -> None:
    """Have ``callback`` run each time vLLM resets ``kv_cache_manager``'s prefix cache, before
    the reset itself. The callback must not raise."""
    reset = getattr(kv_cache_manager, "reset_prefix_cache", None)
    if reset is None:  # a cache manager with no prefix cache to reset
        return

    def reset_prefix_cache(*args, **kwargs):
        callback()
        return reset(*args, **kwargs)

    kv_cache_manager.reset_prefix_cache = reset_prefix_cache


def release_blocks(kv_cache_manager, request) -> None:
    """Give a finished request's blocks back to vLLM's pool (refcounts: a block another request
    shares stays in use)."""
    kv_cache_manager.free(request)
