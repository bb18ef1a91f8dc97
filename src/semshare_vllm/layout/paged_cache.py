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
    is usually a single view); falls back to one stack per layer."""
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
        if step >= first.numel() and all(
            c.storage_offset() - first.storage_offset() == i * step for i, c in enumerate(caches)
        ):
            stacked = torch.as_strided(
                first, (len(caches), *first.shape), (step, *first.stride()), first.storage_offset()
            )
            return [(slice(0, len(caches)), stacked)]
    return [(slice(i, i + 1), c.unsqueeze(0)) for i, c in enumerate(caches)]
