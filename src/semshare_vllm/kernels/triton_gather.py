"""Triton gather + RoPE correction + scatter into paged KV (behind ``gather_rearrange``).

Grid = layers x token tiles, layers on the fast axis so the programs that run together share
their tokens' angle-table rows and offsets in cache. A program computes its tokens' correction
rotation and destination offsets once, then loops over the heads: per head one ``[BLOCK_M, D]``
load of K (as two half-rows for neox pairs; GPT-J loads each dim's partner), one of V, one
store of each.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..layout.paged_cache import stack_layers
from ..layout.specs import PageOffsets
from .rope import RopeTable
from .triton_rope import rope_delta, rope_pairs, rope_rotate

BLOCK_M = 32
NUM_WARPS = 4
_MAX_GRID_Y = 65535


@triton.jit
def _page_offsets(
    k_off_ptr,
    v_off_ptr,
    in_block,
    d,
    mask,
    token_stride,
    channel_stride,
    HEAD_SIZE: tl.constexpr,
    PACKED: tl.constexpr,
):
    """K and V element offsets inside a (block, head) page, ``[BLOCK_M, len(d)]``: computed
    for packed pages (contiguous in d, so stores vectorise), read from the tables otherwise."""
    if PACKED:
        k_off = in_block[:, None] * token_stride + d[None, :] * channel_stride
        v_off = k_off + HEAD_SIZE * channel_stride
    else:
        at = in_block[:, None] * HEAD_SIZE + d[None, :]
        k_off = tl.load(k_off_ptr + at, mask=mask, other=0).to(tl.int64)
        v_off = tl.load(v_off_ptr + at, mask=mask, other=0).to(tl.int64)
    return k_off, v_off


@triton.jit
def _gather_rearrange_kernel(
    src_ptr,
    src_stride_l,
    src_stride_t,
    src_stride_h,
    src_stride_c,
    rows_ptr,
    slots_ptr,
    src_pos_ptr,
    dst_pos_ptr,
    num_tokens,
    dst_ptr,
    dst_stride_l,
    block_stride,
    head_stride,
    k_off_ptr,
    v_off_ptr,
    token_stride,
    channel_stride,
    block_size,
    table_ptr,
    num_heads,
    HEAD_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROTARY_DIM: tl.constexpr,
    IS_NEOX: tl.constexpr,
    HAS_ROPE: tl.constexpr,
    PACKED: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    layer = tl.program_id(0).to(tl.int64)
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    m_ok = m < num_tokens
    ok = m_ok[:, None] & (d < HEAD_SIZE)[None, :]
    rows = tl.load(rows_ptr + m, mask=m_ok, other=0).to(tl.int64)
    slots = tl.load(slots_ptr + m, mask=m_ok, other=0).to(tl.int64)
    blocks, in_block = slots // block_size, slots % block_size
    k_off, v_off = _page_offsets(
        k_off_ptr, v_off_ptr, in_block, d, ok, token_stride, channel_stride, HEAD_SIZE, PACKED
    )
    src_row = src_ptr + layer * src_stride_l + rows[:, None] * src_stride_t
    dst_page = dst_ptr + layer * dst_stride_l + blocks[:, None] * block_stride
    out_dtype = dst_ptr.dtype.element_ty
    # Neox pairs (i, i + R/2) are two contiguous half-rows: load each once, vectorised, instead
    # of every dim loading its partner through an index (GPT-J's interleaved pairs still do).
    SPLIT: tl.constexpr = HAS_ROPE and IS_NEOX
    HALF: tl.constexpr = ROTARY_DIM // 2
    if SPLIT:
        i = tl.arange(0, BLOCK_D // 2)
        i_ok = m_ok[:, None] & (i < HALF)[None, :]
        p_ok = ok & (d >= ROTARY_DIM)[None, :]  # pass-through dims (partial rotary)
        k1_off, _ = _page_offsets(
            k_off_ptr, v_off_ptr, in_block, i, i_ok, token_stride, channel_stride, HEAD_SIZE, PACKED
        )
        k2_off, _ = _page_offsets(
            k_off_ptr,
            v_off_ptr,
            in_block,
            i + HALF,
            i_ok,
            token_stride,
            channel_stride,
            HEAD_SIZE,
            PACKED,
        )
    if HAS_ROPE:
        src_pos = tl.load(src_pos_ptr + m, mask=m_ok, other=0).to(tl.int64)
        dst_pos = tl.load(dst_pos_ptr + m, mask=m_ok, other=0).to(tl.int64)
        if SPLIT:
            cos, sin = rope_delta(table_ptr, src_pos, dst_pos, i, i_ok, ROTARY_DIM)
            same = (src_pos == dst_pos)[:, None]
        else:
            angle, partner, first, rotated = rope_pairs(d, ROTARY_DIM, IS_NEOX)
            cos, sin = rope_delta(
                table_ptr, src_pos, dst_pos, angle, ok & rotated[None, :], ROTARY_DIM
            )
            keep = (src_pos == dst_pos)[:, None] | (~rotated)[None, :]
    for h in range(num_heads):
        # The loop index is int32, and so is a stride that fits one: where heads are outside
        # blocks (vLLM's LHBNC layout) h * head_stride passes 2**31 on a large cache.
        head = tl.cast(h, tl.int64)
        src_head = src_row + head * src_stride_h
        dst_head = dst_page + head * head_stride
        v = tl.load(src_head + (HEAD_SIZE + d[None, :]) * src_stride_c, mask=ok)
        if SPLIT:
            x1 = tl.load(src_head + i[None, :] * src_stride_c, mask=i_ok)
            x2 = tl.load(src_head + (i[None, :] + HALF) * src_stride_c, mask=i_ok)
            f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
            y1 = tl.where(same, x1.to(out_dtype), (f1 * cos - f2 * sin).to(out_dtype))
            y2 = tl.where(same, x2.to(out_dtype), (f2 * cos + f1 * sin).to(out_dtype))
            tl.store(dst_head + k1_off, y1, mask=i_ok)
            tl.store(dst_head + k2_off, y2, mask=i_ok)
            if ROTARY_DIM < HEAD_SIZE:
                xp = tl.load(src_head + d[None, :] * src_stride_c, mask=p_ok)
                tl.store(dst_head + k_off, xp.to(out_dtype), mask=p_ok)
        else:
            x = tl.load(src_head + d[None, :] * src_stride_c, mask=ok)
            if HAS_ROPE:
                xp = tl.load(src_head + partner[None, :] * src_stride_c, mask=ok)
                k = rope_rotate(x, xp, cos, sin, first, keep, out_dtype)
            else:
                k = x.to(out_dtype)
            tl.store(dst_head + k_off, k, mask=ok)
        tl.store(dst_head + v_off, v.to(out_dtype), mask=ok)


def gather_rearrange_triton(
    src: torch.Tensor,
    src_rows: torch.Tensor,
    dst_slots: torch.Tensor,
    caches: list[torch.Tensor],
    offsets: PageOffsets,
    table: RopeTable | None,
    src_pos: torch.Tensor | None,
    dst_pos: torch.Tensor | None,
) -> None:
    """One launch per uniform stack of layer tensors (usually one for the whole model)."""
    num_tokens = src_rows.shape[0]
    tiles = triton.cdiv(num_tokens, BLOCK_M)
    if tiles > _MAX_GRID_Y:
        raise ValueError(f"{num_tokens} tokens exceed one launch; split the move")
    has_rope = table is not None
    head_size = offsets.head_size
    for layers, stack in stack_layers(caches):
        part = src[layers]
        _gather_rearrange_kernel[(stack.shape[0], tiles)](
            part,
            *part.stride(),
            src_rows,
            dst_slots,
            src_pos if has_rope else src_rows,
            dst_pos if has_rope else src_rows,
            num_tokens,
            stack,
            stack.stride(0),
            offsets.block_stride,
            offsets.head_stride,
            offsets.k_offsets,
            offsets.v_offsets,
            offsets.token_stride or 0,
            offsets.channel_stride or 0,
            offsets.block_size,
            table.cos_sin if has_rope else offsets.k_offsets,
            offsets.num_heads,
            HEAD_SIZE=head_size,
            BLOCK_D=triton.next_power_of_2(head_size),
            ROTARY_DIM=table.rotary_dim if has_rope else 2,
            IS_NEOX=table.is_neox if has_rope else True,
            HAS_ROPE=has_rope,
            PACKED=offsets.token_stride is not None,
            BLOCK_M=BLOCK_M,
            num_warps=NUM_WARPS,
            enable_fp_fusion=False,
        )
