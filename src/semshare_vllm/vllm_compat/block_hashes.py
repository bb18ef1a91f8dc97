"""vLLM's prefix-cache keys of a request (``Request.block_hashes``), kept request-only where the
connector wrote approximate KV, and dropped where a load failed.

vLLM caches a request's full blocks under ``request.block_hashes`` when it allocates them (before
any load) and as decoding fills them; each hash is chained from the one before. Approximate KV
must never become another request's exact hit, so from the first block a semantic claim fills,
every hash the request has *and will get* is re-derived with a per-request salt: the existing
ones are rewritten, and the request's block hasher is wrapped so that later hashes are salted
too (whatever the claim's start: a claim that begins in the last, partial block, or a prompt
shorter than one block, has no hash to rewrite yet).

Written against vLLM 0.32 (``Request._block_hasher``, called by ``update_block_hashes``); older
builds bound it as ``Request.get_hash_new_full_blocks``. Either is wrapped.
"""

from __future__ import annotations

import hashlib

_SALT = b"semshare-approx\0"


def make_request_only(request, start: int, block_size: int) -> bool:
    """Salt every block hash of ``request`` from the block holding token ``start`` on, now and
    later. ``block_size`` is the scheduler's (vLLM's hash blocks divide it, so this covers at
    least every block from ``start``). Called again with an earlier ``start`` (vLLM re-asks a
    waiting request whose prefix-cache hit shrank meanwhile), it salts back to there. False
    when this vLLM's request has no hasher we know how to wrap: the caller must then not write
    approximate KV."""
    salt = _SALT + request.request_id.encode()
    first = start // block_size
    done = getattr(request, "_semshare_request_only", None)
    if done is not None and done <= first:
        return True

    def salted(h):
        return type(h)(hashlib.sha256(salt + bytes(h)).digest())

    def salt_new(hashes, base: int, req):
        since = req._semshare_request_only
        return [salted(h) if base + i >= since else h for i, h in enumerate(hashes)]

    if done is None:
        if hasattr(request, "_block_hasher"):
            inner = request._block_hasher
            if inner is not None:  # (no hasher: vLLM never caches this request's blocks)
                request._block_hasher = lambda req: salt_new(inner(req), len(req.block_hashes), req)
        elif hasattr(request, "get_hash_new_full_blocks"):
            inner = request.get_hash_new_full_blocks
            request.get_hash_new_full_blocks = lambda: salt_new(
                inner(), len(request.block_hashes), request
            )
        else:
            return False
    hashes = request.block_hashes
    for i in range(first, len(hashes) if done is None else min(done, len(hashes))):
        hashes[i] = salted(hashes[i])
    request._semshare_request_only = first
    return True


def prefix_hashes(request, first_block: int, end_block: int | None) -> list:
    """The request's block hashes ``[first_block, end_block)`` (None: to its last full block):
    what vLLM caches (or looked up)
    its full blocks under. Hash blocks are the scheduler's blocks here: the connector declines
    layouts with several KV-cache groups, the only ones vLLM hashes in smaller blocks."""
    return list(getattr(request, "block_hashes", ())[first_block:end_block])


def evict_cached(kv_cache_manager, block_ids) -> None:
    """Take blocks out of vLLM's prefix cache (their hashes only: requests holding them keep
    them). vLLM's ``recompute`` load-failure policy leaves failed blocks cached for the running
    request to recompute; one preempted or aborted first would leave never-written KV there."""
    if kv_cache_manager is not None and block_ids:
        kv_cache_manager.evict_blocks(set(block_ids))
