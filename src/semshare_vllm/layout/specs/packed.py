"""Packed pages (FLASH_ATTN, TRITON_ATTN, FLEX_ATTENTION, FlashInfer, ROCm): each token's K is
``kv[..., :D]`` and its V ``kv[..., D:]``, for any stride permutation of ``[B, H, N, C]`` (the
physical order may be token-major, ``[B, N, H, C]``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import PageSpec, split_slots
from .offsets import PageOffsets


@dataclass(frozen=True)
class PackedKVSpec(PageSpec):
    def _split(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.check(kv_cache)
        return kv_cache[..., : self.head_size], kv_cache[..., self.head_size :]

    def offsets(self, kv_cache: torch.Tensor) -> PageOffsets:
        self.check(kv_cache)
        n = torch.arange(kv_cache.shape[2])[:, None] * kv_cache.stride(2)
        c = torch.arange(kv_cache.shape[3])[None, :] * kv_cache.stride(3)
        d = self.head_size
        return PageOffsets.build(
            kv_cache,
            n + c[:, :d],
            n + c[:, d:],
            token_stride=kv_cache.stride(2),
            channel_stride=kv_cache.stride(3),
        )

    def read(self, kv_cache, slots):
        k, v = self._split(kv_cache)
        blocks, offsets = split_slots(slots, kv_cache.shape[2], k.device)
        return k[blocks, :, offsets], v[blocks, :, offsets]

    def write(self, kv_cache, slots, k, v):
        k_pages, v_pages = self._split(kv_cache)
        blocks, offsets = split_slots(slots, kv_cache.shape[2], k_pages.device)
        k_pages[blocks, :, offsets] = k.to(device=k_pages.device, dtype=k_pages.dtype)
        v_pages[blocks, :, offsets] = v.to(device=v_pages.device, dtype=v_pages.dtype)

    def read_blocks(self, kv_cache, blocks):
        k, v = self._split(kv_cache)
        blocks = blocks.to(k.device)
        return tuple(x.index_select(0, blocks).transpose(1, 2).flatten(0, 1) for x in (k, v))

    def write_blocks(self, kv_cache, blocks, k, v):
        block_size = kv_cache.shape[2]
        blocks = blocks.to(kv_cache.device)
        for dst, src in zip(self._split(kv_cache), (k, v)):
            pages = src.to(device=dst.device, dtype=dst.dtype).unflatten(0, (-1, block_size))
            dst[blocks] = pages.transpose(1, 2)
