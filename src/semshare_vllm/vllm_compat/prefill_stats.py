"""vLLM internals: how many prompt tokens vLLM's own prefix cache served a request at its
admission, for the request's provenance.

vLLM records it on the request (``Request.prefill_stats``, a ``PrefillStats`` whose
``num_local_cached_tokens`` ``Scheduler.schedule`` sets before ``allocate_slots``, so it is
readable in ``update_state_after_alloc``) for the first admission only, never after a preemption,
and takes it off the request with the request's first output. Written against vLLM 0.32 and
0.33 (the same code in both).
"""

from __future__ import annotations


def local_cache_hit(request) -> int | None:
    """vLLM's own prefix-cache hit for ``request``'s current admission; None where vLLM does not
    say (another version, or a request admitted again after a preemption, whose figures vLLM
    keeps from its first admission)."""
    if getattr(request, "num_preemptions", 0):
        return None
    hit = getattr(getattr(request, "prefill_stats", None), "num_local_cached_tokens", None)
    return hit if isinstance(hit, int) and not isinstance(hit, bool) else None
