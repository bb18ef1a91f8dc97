"""One address scheme for every paged KV layout, so one kernel writes them all.

Element d of the K (or V) of the token at in-block offset n, head h, block b of one layer's
``[num_blocks, H, N, 2*D]`` tensor sits at element offset

    b * block_stride + h * head_stride + k_offsets[n, d]     (v_offsets for V)

from the tensor's first element. The packed layouts (K = ``[..., :D]``, V = ``[..., D:]``, any
stride permutation) and the CPU_ATTN pages (a K region then a V region, each in the order
vLLM's CPU kernel uses) differ only in the two ``[N, D]`` offset tables.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..layout.kv_layout import PackedKVView, PagedRegionKVView, PageLayout, UnsupportedKVLayout


@dataclass(frozen=True, eq=False)  # holds tensors: compare by identity
class PageAddressing:
    """Where K / V elements go in layer tensors of one ``shape`` and ``strides``."""

    block_stride: int
    head_stride: int
    k_offsets: torch.Tensor  # [N, D] int32, element offsets inside a (block, head) page
    v_offsets: torch.Tensor
    shape: tuple[int, int, int, int]  # [num_blocks, H, N, 2*D] of the tensors addressed
    strides: tuple[int, int, int, int]
    # Packed layouts only: k_offsets[n, d] = n * token_stride + d * channel_stride (V: + D
    # channels). Kernels compute these instead of reading the tables, so that a GPU's stores
    # are known contiguous and vectorise (a table read hides that: 11x slower at 32K tokens
    # on an H100, benchmarks/kernel_throughput.py).
    token_stride: int | None = None
    channel_stride: int | None = None

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

    def to(self, device: torch.device | str) -> PageAddressing:
        if self.k_offsets.device == torch.device(device):
            return self
        return PageAddressing(self.block_stride, self.head_stride, self.k_offsets.to(device),
                              self.v_offsets.to(device), self.shape, self.strides,
                              self.token_stride, self.channel_stride)

    def flat_indices(self, slots: torch.Tensor) -> torch.Tensor:
        """``[M, H, 2*D]`` int64 element offsets of the K then V of each slot, all heads."""
        slots = slots.to(device=self.k_offsets.device, dtype=torch.long)
        blocks, offsets = slots // self.block_size, slots % self.block_size
        heads = torch.arange(self.num_heads, device=slots.device) * self.head_stride
        page = (blocks * self.block_stride)[:, None, None] + heads[None, :, None]
        in_page = torch.cat((self.k_offsets, self.v_offsets), dim=1).long()[offsets]
        return page + in_page[:, None, :]

    @classmethod
    def _make(cls, kv_cache: torch.Tensor, k_offsets: torch.Tensor, v_offsets: torch.Tensor,
              token_stride: int | None = None,
              channel_stride: int | None = None) -> PageAddressing:
        if max(int(k_offsets.max()), int(v_offsets.max())) >= 2 ** 31:
            raise UnsupportedKVLayout("in-page offsets overflow int32")
        return cls(kv_cache.stride(0), kv_cache.stride(1),
                   k_offsets.to(device=kv_cache.device, dtype=torch.int32).contiguous(),
                   v_offsets.to(device=kv_cache.device, dtype=torch.int32).contiguous(),
                   tuple(kv_cache.shape), tuple(kv_cache.stride()), token_stride, channel_stride)

    @classmethod
    def packed(cls, kv_cache: torch.Tensor) -> PageAddressing:
        """K = ``kv[..., :D]``, V = ``kv[..., D:]``, for any stride permutation of [B, H, N, C]."""
        _, _, block_size, channels = _check_shape(kv_cache)
        n = torch.arange(block_size)[:, None] * kv_cache.stride(2)
        c = torch.arange(channels)[None, :] * kv_cache.stride(3)
        head_size = channels // 2
        return cls._make(kv_cache, n + c[:, :head_size], n + c[:, head_size:],
                         kv_cache.stride(2), kv_cache.stride(3))

    @classmethod
    def cpu_pages(cls, kv_cache: torch.Tensor, k_pos: torch.Tensor,
                  v_pos: torch.Tensor) -> PageAddressing:
        """CPU_ATTN: each (block, head) page is a K region of N*D elements then a V region;
        ``k_pos`` / ``v_pos`` (``layout.kv_layout.calibrate_cpu_pages``) order each region."""
        _, _, block_size, channels = _check_shape(kv_cache)
        if kv_cache.stride(2) != channels * kv_cache.stride(3):
            raise UnsupportedKVLayout("KV pages are not contiguous")
        region = block_size * (channels // 2)
        step = kv_cache.stride(3)
        return cls._make(kv_cache, k_pos.long() * step, (region + v_pos.long()) * step)

    @classmethod
    def from_layout(cls, layout: PageLayout, kv_cache: torch.Tensor) -> PageAddressing:
        """The addressing of ``kv_cache`` (one layer's tensor) under ``layout``."""
        view = layout.view(kv_cache)  # validates the backend and shape
        if isinstance(view, PackedKVView):
            return cls.packed(kv_cache)
        if isinstance(view, PagedRegionKVView):
            return cls.cpu_pages(kv_cache, view.k_pos, view.v_pos)
        raise UnsupportedKVLayout(f"no page addressing for {type(view).__name__}")


def _check_shape(kv_cache: torch.Tensor) -> tuple[int, int, int, int]:
    if kv_cache.dim() != 4 or kv_cache.shape[3] % 2:
        raise UnsupportedKVLayout(f"expected [B, H, N, 2*D], got {tuple(kv_cache.shape)}")
    return tuple(kv_cache.shape)
