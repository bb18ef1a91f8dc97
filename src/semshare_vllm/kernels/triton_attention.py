"""Triton kernel behind ``position_attention.attend_by_position`` on CUDA.

Flash-attention's forward (online softmax over key blocks, fp32 accumulators), with the causal
mask taken by position: each program holds ``BLOCK_M`` consecutive queries of one query head,
reads its KV head's keys only up to its last query's position, and masks per query only where
a key block passes that query's position. So scattered queries cost their own keys and no
more, in one launch, where a masked SDPA call makes and reads a mask of every query by every
key (docs/benchmarks.md, "The recompute's attention on a GPU").
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

BLOCK_M = 64
BLOCK_N = 64
NUM_WARPS = 4
NUM_STAGES = 2


@triton.jit
def _attend_kernel(
    Q,
    K,
    V,
    OUT,
    QPOS,
    scale,
    num_queries,
    stride_qs,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_os,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    block = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    valid = rows < num_queries
    dim_ok = dims < HEAD
    pos = tl.load(QPOS + rows, mask=valid, other=-1)
    q = tl.load(
        Q + rows[:, None].to(tl.int64) * stride_qs + head * stride_qh + dims[None, :],
        mask=valid[:, None] & dim_ok[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    last = tl.max(pos, 0)  # the block's last key
    first = tl.min(tl.where(valid, pos, last), 0)  # keys up to here every query sees
    # finite floor, not -inf: a row with no key yet in a block must not make inf - inf
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(0, last + 1, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_ok = keys <= last
        k = tl.load(
            K + keys[:, None].to(tl.int64) * stride_ks + kv_head * stride_kh + dims[None, :],
            mask=key_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )
        if UPCAST:
            k = k.to(tl.float32)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale
        if start + BLOCK_N - 1 > first:  # some query of the block ends inside this block
            s = tl.where(keys[None, :] <= pos[:, None], s, -1.0e30)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            V + keys[:, None].to(tl.int64) * stride_vs + kv_head * stride_vh + dims[None, :],
            mask=key_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )
        if UPCAST:
            v = v.to(tl.float32)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        OUT + rows[:, None].to(tl.int64) * stride_os + head * stride_oh + dims[None, :],
        out.to(OUT.dtype.element_ty),
        mask=valid[:, None] & dim_ok[None, :],
    )


def attend_by_position(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float
) -> torch.Tensor:
    """q ``[S, Hq, D]`` at sorted positions ``q_pos``, k / v ``[n, Hkv, D]`` (positions 0..n-1;
    each with a unit last stride) -> ``[S, Hq, D]`` in q's dtype."""
    s, num_heads, head = q.shape
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if s == 0:
        return out
    k, v = k.to(q.dtype), v.to(q.dtype)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    grid = (triton.cdiv(s, BLOCK_M), num_heads)
    _attend_kernel[grid](
        q,
        k,
        v,
        out,
        q_pos.to(device=q.device, dtype=torch.int32).contiguous(),
        scale,
        s,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
        GROUP=num_heads // k.shape[1],
        HEAD=head,
        BLOCK_D=triton.next_power_of_2(head),
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        IEEE=q.dtype == torch.float32,
        # Triton's interpreter (the CPU tests) multiplies bf16 tiles wrongly in tl.dot: there
        # they go in as fp32; compiled, bf16 tiles go to the tensor cores as they are.
        UPCAST=q.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1",
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
    )
    return out
