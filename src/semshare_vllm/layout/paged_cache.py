"""Helpers on paged KV tensors that hold for every page layout: slot numbers and layer stacks."""

from __future__ import annotations

import torch


def slots_for(block_ids: list[int], start: int, stop: int, block_size: int) -> torch.Tensor:
    """Paged-cache slot (``block_id * block_size + offset``) of each token position in
    ``[start, stop)`` of a request whose blocks are ``block_ids``."""
    pos = torch.arange(start, stop, dtype=torch.long)
    blocks = torch.as_tensor(block_ids, dtype=torch.long)[pos // block_size]
    return blocks * block_size + pos % block_size


def stack_layers(caches: list[torch.Tensor]) -> list[tuple[slice, torch.Tensor]]:
    """The per-layer KV tensors as ``[layers, blocks, H, N, C]`` stacks, for copies that move
    every layer in one op (vLLM allocates all layers in one buffer, at a uniform stride, so this
    is usually a single view; in block-outer layouts the layers interleave inside each block,
    and the stack is still one view as long as no two of its elements share an address); falls
    back to one stack per layer."""
    first = caches[0]
    uniform = len(caches) > 1 and all(
        c.shape == first.shape
        and c.stride() == first.stride()
        and c.dtype == first.dtype
        and c.device == first.device
        and c.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        for c in caches
    )
    if uniform:
        step = caches[1].storage_offset() - first.storage_offset()
        shape, strides = (len(caches), *first.shape), (step, *first.stride())
        if _distinct_addresses(shape, strides) and all(
            c.storage_offset() - first.storage_offset() == i * step for i, c in enumerate(caches)
        ):
            stacked = torch.as_strided(first, shape, strides, first.storage_offset())
            return [(slice(0, len(caches)), stacked)]
    return per_layer_stacks(caches)


def per_layer_stacks(caches: list[torch.Tensor]) -> list[tuple[slice, torch.Tensor]]:
    """One ``[1, blocks, H, N, C]`` stack per layer: ``stack_layers``' fallback."""
    return [(slice(i, i + 1), c.unsqueeze(0)) for i, c in enumerate(caches)]


def _distinct_addresses(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """Whether a view of this shape and these strides gives every element its own address:
    taken from the smallest stride up, each axis must step past all that the smaller ones
    span (mixed radix; true of any axis order of a dense buffer, false where layers overlap)."""
    span = 0
    for size, stride in sorted(zip(shape, strides), key=lambda axis: axis[1]):
        if size == 1:
            continue
        if stride <= span:
            return False
        span += (size - 1) * stride
    return True
