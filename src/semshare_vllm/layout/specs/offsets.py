"""``PageOffsets``: where every K and V element of one layer tensor sits, as the kernels read it.

Element d of the K (or V) of the token at in-block offset n, head h, block b of a
``[num_blocks, H, N, 2*D]`` tensor sits at element offset

    b * block_stride + h * head_stride + k_offsets[n, d]     (v_offsets for V)

from the tensor's first element. Every page layout differs only in the two ``[N, D]`` tables;
each ``PageSpec`` builds them (``spec.offsets(kv_cache)``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import UnsupportedKVLayout


@dataclass(frozen=True, eq=False)  # holds tensors: compare by identity
class PageOffsets:
    """Where K / V elements go in layer tensors of one ``shape`` and ``strides``."""

    block_stride: int
    head_stride: int
    k_offsets: torch.Tensor  # [N, D] int32, element offsets inside a (block, head) page
    v_offsets: torch.Tensor
    shape: tuple[int, int, int, int]  # [num_blocks, H, N, 2*D] of the tensors addressed
    strides: tuple[int, int, int, int]
    # Packed layouts only: k_offsets[n, d] = n * token_stride + d * channel_stride (V: + D
    # channels). Kernels compute these instead of reading the tables, so that a GPU's stores
    # are known contiguous and vectorise (a table read hides that; see
    # benchmarks/kernel_throughput.py).
    token_stride: int | None = None
    channel_stride: int | None = None

    @classmethod
    def build(
        cls,
        kv_cache: torch.Tensor,
        k_offsets: torch.Tensor,
        v_offsets: torch.Tensor,
        token_stride: int | None = None,
        channel_stride: int | None = None,
    ) -> PageOffsets:
        """The offsets of ``kv_cache`` given its in-page tables (any integer dtype)."""
        if max(int(k_offsets.max()), int(v_offsets.max())) >= 2**31:
            raise UnsupportedKVLayout("in-page offsets overflow int32")
        return cls(
            kv_cache.stride(0),
            kv_cache.stride(1),
            k_offsets.to(device=kv_cache.device, dtype=torch.int32).contiguous(),
            v_offsets.to(device=kv_cache.device, dtype=torch.int32).contiguous(),
            tuple(kv_cache.shape),
            tuple(kv_cache.stride()),
            token_stride,
            channel_stride,
        )

    @property
    def num_heads(self) -> int:
        return self.shape[1]

    @property
    def block_size(self) -> int:
        return self.shape[2]

    @property
    def head_size(self) -> int:
        return self.shape[3] // 2

    def fits(self, kv_cache: torch.Tensor) -> bool:
        """Whether ``kv_cache`` has the shape and strides these offsets were made for."""
        return tuple(kv_cache.shape) == self.shape and tuple(kv_cache.stride()) == self.strides

    def to(self, device: torch.device | str) -> PageOffsets:
        if self.k_offsets.device == torch.device(device):
            return self
        return PageOffsets(
            self.block_stride,
            self.head_stride,
            self.k_offsets.to(device),
            self.v_offsets.to(device),
            self.shape,
            self.strides,
            self.token_stride,
            self.channel_stride,
        )

    def flat_indices(self, slots: torch.Tensor) -> torch.Tensor:
        """``[M, H, 2*D]`` int64 element offsets of the K then V of each slot, all heads."""
        slots = slots.to(device=self.k_offsets.device, dtype=torch.long)
        blocks, offsets = slots // self.block_size, slots % self.block_size
        heads = torch.arange(self.num_heads, device=slots.device) * self.head_stride
        page = (blocks * self.block_stride)[:, None, None] + heads[None, :, None]
        in_page = torch.cat((self.k_offsets, self.v_offsets), dim=1).long()[offsets]
        return page + in_page[:, None, :]
