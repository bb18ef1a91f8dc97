"""Triton RoPE correction: the jit helpers shared with the gather kernel, and the standalone
kernel behind ``rope.correct_rope``.

Each program works on a ``[BLOCK_M tokens, BLOCK_D dims]`` tile of one head. Every dim d loads
its own value and its pair partner's, so neox, GPT-J and partial rotary are one code path: the
pair member decides the sign, dims past ``rotary_dim`` keep their value. The float ops and their
order match ``rope.rope_delta`` / ``rope.apply_rope_delta``; multiply-add fusion is turned off
at launch so that GPUs round each product like torch does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .rope import RopeTable

BLOCK_M = 32
NUM_WARPS = 4


@triton.jit
def rope_pairs(d, ROTARY_DIM: tl.constexpr, IS_NEOX: tl.constexpr):
    """Per head dim d: its angle index, its pair partner, whether it is the pair's first member,
    whether it is rotated at all."""
    HALF: tl.constexpr = ROTARY_DIM // 2
    rotated = d < ROTARY_DIM
    if IS_NEOX:
        first = d < HALF
        angle = tl.where(first, d, d - HALF)
        partner = tl.where(first, d + HALF, d - HALF)
    else:
        first = (d % 2) == 0
        angle = d // 2
        partner = tl.where(first, d + 1, d - 1)
    angle = tl.where(rotated, angle, 0)
    partner = tl.where(rotated, partner, d)
    return angle, partner, first, rotated


@triton.jit
def rope_delta(table_ptr, src_pos, dst_pos, angle, mask, ROTARY_DIM: tl.constexpr):
    """cos/sin of the p -> q correction, ``[BLOCK_M, BLOCK_D]`` fp32 (positions ``[BLOCK_M]``
    int64, angle indices ``[BLOCK_D]``)."""
    HALF: tl.constexpr = ROTARY_DIM // 2
    p_row = table_ptr + src_pos[:, None] * ROTARY_DIM + angle[None, :]
    q_row = table_ptr + dst_pos[:, None] * ROTARY_DIM + angle[None, :]
    cp = tl.load(p_row, mask=mask, other=1.0)
    sp = tl.load(p_row + HALF, mask=mask, other=0.0)
    cq = tl.load(q_row, mask=mask, other=1.0)
    sq = tl.load(q_row + HALF, mask=mask, other=0.0)
    cos = cq * cp + sq * sp
    sin = sq * cp - cq * sp
    return cos, sin


@triton.jit
def rope_rotate(x_raw, x_partner, cos, sin, first, keep, OUT_DTYPE: tl.constexpr):
    """Rotate each dim with its partner in fp32 and cast once; ``keep`` ([BLOCK_M, BLOCK_D]:
    dims past rotary_dim, tokens with p == q) copies the raw value instead."""
    x = x_raw.to(tl.float32)
    xp = x_partner.to(tl.float32)
    turned = tl.where(first[None, :], x * cos - xp * sin, x * cos + xp * sin)
    return tl.where(keep, x_raw.to(OUT_DTYPE), turned.to(OUT_DTYPE))


@triton.jit
def _rope_correct_kernel(
    k_ptr,
    k_stride_t,
    k_stride_h,
    k_stride_d,
    out_ptr,
    out_stride_t,
    out_stride_h,
    out_stride_d,
    src_pos_ptr,
    dst_pos_ptr,
    table_ptr,
    num_tokens,
    HEAD_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROTARY_DIM: tl.constexpr,
    IS_NEOX: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    head = tl.program_id(0).to(tl.int64)
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    m_ok = m < num_tokens
    ok = m_ok[:, None] & (d < HEAD_SIZE)[None, :]
    src_pos = tl.load(src_pos_ptr + m, mask=m_ok, other=0).to(tl.int64)
    dst_pos = tl.load(dst_pos_ptr + m, mask=m_ok, other=0).to(tl.int64)
    angle, partner, first, rotated = rope_pairs(d, ROTARY_DIM, IS_NEOX)
    cos, sin = rope_delta(table_ptr, src_pos, dst_pos, angle, ok & rotated[None, :], ROTARY_DIM)
    row = k_ptr + m.to(tl.int64)[:, None] * k_stride_t + head * k_stride_h
    x = tl.load(row + d[None, :] * k_stride_d, mask=ok)
    xp = tl.load(row + partner[None, :] * k_stride_d, mask=ok)
    keep = (src_pos == dst_pos)[:, None] | (~rotated)[None, :]
    y = rope_rotate(x, xp, cos, sin, first, keep, out_ptr.dtype.element_ty)
    dst = out_ptr + m.to(tl.int64)[:, None] * out_stride_t + head * out_stride_h
    tl.store(dst + d[None, :] * out_stride_d, y, mask=ok)


def rope_correct_triton(
    k: torch.Tensor,
    src_pos: torch.Tensor,
    dst_pos: torch.Tensor,
    table: RopeTable,
    out: torch.Tensor,
) -> None:
    """Launch: grid = heads x token tiles. ``out`` may be ``k`` (each program reads its whole
    tile, pair partners included, before writing it)."""
    num_tokens, num_heads, head_size = k.shape
    grid = (num_heads, triton.cdiv(num_tokens, BLOCK_M))
    _rope_correct_kernel[grid](
        k,
        *k.stride(),
        out,
        *out.stride(),
        src_pos,
        dst_pos,
        table.cos_sin,
        num_tokens,
        HEAD_SIZE=head_size,
        BLOCK_D=triton.next_power_of_2(head_size),
        ROTARY_DIM=table.rotary_dim,
        IS_NEOX=table.is_neox,
        BLOCK_M=BLOCK_M,
        num_warps=NUM_WARPS,
        enable_fp_fusion=False,
    )
