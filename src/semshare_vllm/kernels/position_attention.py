"""Causal attention of queries at scattered positions over a request's keys: how a recomputed
layer's queries attend off vLLM's CPU backend.

``attend_by_position(q, k, v, q_pos, scale)``: q ``[S, Hq, D]`` at sorted positions ``q_pos``,
k / v ``[n, Hkv, D]`` at positions 0..n-1 (grouped KV heads), each query attending to the keys
up to its own position -> ``[S, Hq, D]``. On CUDA the Triton kernel (``triton_attention``) reads
only the keys each block of queries needs, in one launch; elsewhere, and where the queries are
every position (the plain causal kernel), torch SDPA (``attend_by_position_reference``).
``impl="torch"`` / ``"triton"`` forces one (``"triton"`` on CPU tensors needs
``TRITON_INTERPRET=1``, as in the tests). Shapes whose tiles do not fit a GPU's shared memory
fall back to the torch version (logged once per shape).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from .dispatch import use_triton

logger = logging.getLogger("vllm.semshare.kernels")


def attend_by_position(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    scale: float,
    impl: str = "auto",
) -> torch.Tensor:
    if _every_position(q_pos, k.shape[0]):
        return _sdpa(q, k, v, None, scale)  # the plain causal kernel, on any device
    shape = (q.dtype, q.shape[1], k.shape[1], q.shape[2], q.device)
    if use_triton(q, impl) and shape not in _TOO_BIG:
        from triton.runtime.errors import OutOfResources

        from .triton_attention import attend_by_position as triton_attend

        try:
            return triton_attend(q, k, v, q_pos, scale)
        except OutOfResources as exc:
            # Its tiles outgrow this GPU's shared memory (fp32 at head 128 on an L4, say):
            # the torch version serves these shapes from now on.
            _TOO_BIG.add(shape)
            logger.warning(
                "SemShare: the Triton attention kernel does not fit this GPU for %s "
                "(%s); the recompute attends through torch SDPA for these shapes",
                shape[:4],
                exc,
            )
    return _attend_in_chunks(q, k, v, q_pos, scale)


_TOO_BIG: set[tuple] = set()  # (dtype, Hq, Hkv, D, device) the kernel did not fit


def _every_position(q_pos: torch.Tensor, n: int) -> bool:
    """The queries are positions 0..n-1, all of them (sorted and distinct, so the ends tell)."""
    return len(q_pos) == n and int(q_pos[0]) == 0 and int(q_pos[-1]) == n - 1


def attend_by_position_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float
) -> torch.Tensor:
    """Torch reference: SDPA (fp32 softmax), the plain causal kernel where the queries are
    every position, else masked calls over chunks of consecutive queries."""
    if _every_position(q_pos, k.shape[0]):
        return _sdpa(q, k, v, None, scale)
    return _attend_in_chunks(q, k, v, q_pos, scale)


def _attend_in_chunks(q, k, v, q_pos, scale):
    s = q.shape[0]
    out = torch.empty_like(q)
    chunks = attend_chunks(s, int(q_pos[-1]) + 1, q.shape[1], q.device)
    bounds = [s * i // chunks for i in range(chunks + 1)]
    for lo, hi in zip(bounds, bounds[1:]):
        pos = q_pos[lo:hi]
        m = int(pos[-1]) + 1
        mask = torch.arange(m, device=q.device)[None, :] <= pos[:, None]
        out[lo:hi] = _sdpa(q[lo:hi], k[:m], v[:m], mask, scale)
    return out


def attend_chunks(queries: int, keys: int, heads: int, device: torch.device) -> int:
    """How many masked SDPA calls the torch version makes, each over consecutive queries and
    the keys up to its last one. On CPU, ``ATTEND_CHUNKS``: a masked kernel skips no key
    blocks, and chunks read about half the keys (docs/benchmarks.md, "Selective recompute").
    On a GPU (where this version runs only without Triton) a masked call has a fixed cost
    larger than what the skipped keys save (cuDNN on an H200: one call 3.2x faster than eight
    at 8K tokens, docs/benchmarks.md "The recompute's attention on a GPU"), so chunks there
    only bound each call's scores, ``heads`` by rows by keys, to ``ATTEND_SCORE_ELEMENTS``:
    where SDPA has no fused kernel for a mask with grouped heads (no cuDNN), its math kernel
    makes them in fp32, inside the memory vLLM leaves free beside its KV cache."""
    if device.type == "cpu":
        return max(1, min(ATTEND_CHUNKS, queries // ATTEND_MIN_CHUNK))
    rows = max(1, ATTEND_SCORE_ELEMENTS // (keys * heads))  # per call
    return -(-queries // rows)


ATTEND_CHUNKS = 8
ATTEND_MIN_CHUNK = 32
ATTEND_SCORE_ELEMENTS = 1 << 28


def _sdpa(q, k, v, mask, scale):
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0).to(q.dtype),
        v.transpose(0, 1).unsqueeze(0).to(q.dtype),
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out[0].transpose(0, 1)
