"""Fused gather + RoPE correction + scatter of staged donor KV into a target's paged cache.

A staging tensor ``src`` ``[L, T_src, H, 2*D]`` (K then V in the last dim, any strides) holds
donor KV by row. Each moved token m takes row ``src_rows[m]`` of every layer, has its K
re-rotated from donor position ``src_pos[m]`` to target position ``dst_pos[m]`` (``table=None``:
no correction), and lands in slot ``dst_slots[m]`` (``block_id * block_size + offset``) of the
per-layer caches, addressed through the ``PageOffsets`` of their layout
(``layout.specs``: ``spec.offsets(caches[0])``; packed or CPU_ATTN pages alike).
V is copied as is; both are cast to the cache dtype. Destination slots must be distinct (a
duplicated slot gets one of its writers, unspecified which); source rows may repeat.
"""

from __future__ import annotations

import torch

from ..layout.specs import PageOffsets
from .dispatch import use_triton
from .rope import RopeTable, apply_rope_delta, rope_delta


def _check_inputs(src, src_rows, dst_slots, caches, offsets, table, src_pos, dst_pos):
    if src.dim() != 4:
        raise ValueError(f"src must be [L, T, H, 2*D], got {tuple(src.shape)}")
    if src.shape[0] != len(caches):
        raise ValueError(f"src has {src.shape[0]} layers, caches {len(caches)}")
    if src.shape[2:] != (offsets.num_heads, 2 * offsets.head_size):
        raise ValueError(
            f"src heads/channels {tuple(src.shape[2:])} do not match the cache "
            f"{(offsets.num_heads, 2 * offsets.head_size)}"
        )
    if src_rows.dim() != 1 or dst_slots.shape != src_rows.shape:
        raise ValueError("src_rows and dst_slots must be 1-D of the same length")
    for cache in caches:
        if not offsets.fits(cache):
            raise ValueError("a cache tensor's shape/strides differ from the offsets'")
        if cache.device != src.device:
            raise ValueError("caches and src must be on the same device")
    if table is not None:
        if src_pos is None or dst_pos is None:
            raise ValueError("RoPE correction needs src_pos and dst_pos")
        if src_pos.shape != src_rows.shape or dst_pos.shape != src_rows.shape:
            raise ValueError("src_pos and dst_pos must be [M] like src_rows")
        if table.head_size != offsets.head_size:
            raise ValueError(f"rope head_size {table.head_size} != cache {offsets.head_size}")


def _flat(cache: torch.Tensor) -> torch.Tensor:
    """A 1-D view over the storage span of ``cache``, from its first element."""
    span = 1 + sum((size - 1) * stride for size, stride in zip(cache.shape, cache.stride()))
    return cache.as_strided((span,), (1,), cache.storage_offset())


def gather_rearrange_reference(
    src: torch.Tensor,
    src_rows: torch.Tensor,
    dst_slots: torch.Tensor,
    caches: list[torch.Tensor],
    offsets: PageOffsets,
    table: RopeTable | None = None,
    src_pos: torch.Tensor | None = None,
    dst_pos: torch.Tensor | None = None,
) -> None:
    """Torch reference: destination offsets and the RoPE rotation are computed once, then each
    layer is one row gather, one rotation and one scatter."""
    _check_inputs(src, src_rows, dst_slots, caches, offsets, table, src_pos, dst_pos)
    if src_rows.numel() == 0:
        return
    device, head_size = src.device, offsets.head_size
    index = offsets.to(device).flat_indices(dst_slots)  # [M, H, 2*D]
    rows = src_rows.to(device=device, dtype=torch.long)
    if table is not None:
        table = table.to(device)
        delta = rope_delta(table, src_pos, dst_pos)
    for layer, cache in enumerate(caches):
        moved = src[layer].index_select(0, rows)  # [M, H, 2*D], a fresh copy
        kv = moved if moved.dtype == cache.dtype else torch.empty_like(moved, dtype=cache.dtype)
        if kv is not moved:
            kv[..., head_size:] = moved[..., head_size:]
        if table is not None:  # rotate from the source values, cast once into kv
            apply_rope_delta(moved[..., :head_size], delta, table, kv[..., :head_size])
        elif kv is not moved:
            kv[..., :head_size] = moved[..., :head_size]
        _flat(cache).index_put_((index,), kv)


def gather_rearrange(
    src: torch.Tensor,
    src_rows: torch.Tensor,
    dst_slots: torch.Tensor,
    caches: list[torch.Tensor],
    offsets: PageOffsets,
    table: RopeTable | None = None,
    src_pos: torch.Tensor | None = None,
    dst_pos: torch.Tensor | None = None,
    impl: str = "auto",
) -> None:
    """Move ``src[:, src_rows]`` into ``dst_slots`` of every layer's cache, K RoPE-corrected
    from ``src_pos`` to ``dst_pos`` when ``table`` is given. Triton on CUDA (one launch for all
    layers when they form one uniform stack), the torch reference otherwise; ``impl`` =
    "triton" / "torch" forces one."""
    if not use_triton(src, impl):
        gather_rearrange_reference(
            src, src_rows, dst_slots, caches, offsets, table, src_pos, dst_pos
        )
        return
    _check_inputs(src, src_rows, dst_slots, caches, offsets, table, src_pos, dst_pos)
    if src_rows.numel() == 0:
        return
    from .triton_gather import gather_rearrange_triton

    device = src.device
    if table is not None:
        table, src_pos, dst_pos = table.to(device), src_pos.to(device), dst_pos.to(device)
    gather_rearrange_triton(
        src,
        src_rows.to(device),
        dst_slots.to(device),
        caches,
        offsets.to(device),
        table,
        src_pos,
        dst_pos,
    )


def stage_rows(
    pages: torch.Tensor | list[torch.Tensor], slots: torch.Tensor, offsets: PageOffsets
) -> torch.Tensor:
    """The K|V rows at ``slots`` of every layer's pages, as ``gather_rearrange``'s staging
    tensor ``[L, M, H, 2*D]`` (the inverse of its scatter, without the rotation): one element
    gather per layer through the same offsets (faster than reading K and V apart and
    concatenating them: docs/benchmarks.md, "Kernels")."""
    pages = list(pages)
    if not pages:
        raise ValueError("no layers to stage")
    index = offsets.to(pages[0].device).flat_indices(slots).view(-1)
    out = torch.empty(
        (len(pages), slots.shape[0], offsets.num_heads, 2 * offsets.head_size),
        dtype=pages[0].dtype,
        device=pages[0].device,
    )
    for layer, page in enumerate(pages):
        # any number of blocks (a host pool's, a cache's), the same pages
        if tuple(page.shape[1:]) != offsets.shape[1:] or tuple(page.stride()) != offsets.strides:
            raise ValueError("a page tensor's page shape/strides differ from the offsets'")
        torch.index_select(_flat(page), 0, index, out=out[layer].view(-1))
    return out
