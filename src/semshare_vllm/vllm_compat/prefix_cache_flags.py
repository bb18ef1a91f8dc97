"""vLLM's per-request ``skip_reading_prefix_cache`` flag, let down for one check so that a
connector claim can stand.

vLLM sets ``Request.skip_reading_prefix_cache`` for requests that must read no cache (prompt
logprobs, pooling): its own prefix cache is not looked up for them (``KVCacheManager``), and
right after asking the connector the scheduler drops the answer (``Scheduler.schedule``: ext
tokens 0). A request that asks for prompt logprobs with a reuse limit may still be served: the
flag is cleared for that check (``allow_connector_claim``) and set back once the claim is
allocated or at the end of the step (``restore_cache_skip``), so vLLM's own prefix cache, looked
up before the connector, never serves it. Which requests are let through, and until when, is the
scheduler's bookkeeping.

Written against vLLM 0.32: the flag is set from the sampling or pooling params in
``Request.__init__`` and read by ``Scheduler.schedule`` and
``KVCacheManager.prefix_cache_lookup_enabled``. (0.33 keeps the flag; only 0.32 was run.)
"""

from __future__ import annotations


def wants_cache_skip(request) -> bool:
    """Whether vLLM reads no cache for ``request``, the connector's claim included."""
    return bool(getattr(request, "skip_reading_prefix_cache", False))


def allow_connector_claim(request) -> None:
    """Let vLLM's check right after asking the connector keep the connector's answer."""
    request.skip_reading_prefix_cache = False


def restore_cache_skip(request) -> None:
    """Set the flag back: vLLM reads no cache for ``request`` again."""
    request.skip_reading_prefix_cache = True
