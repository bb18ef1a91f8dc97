"""(K, V) access to one layer's paged KV tensor, one implementation per attention-backend layout.

vLLM 0.32/0.33 hands a connector one logical ``[num_blocks, num_kv_heads, block_size, C]``
tensor per layer, C = 2 * head_size, but backends lay tokens out differently:

* packed (FLASH_ATTN, TRITON_ATTN, FLEX_ATTENTION, FlashInfer): K = ``kv[..., :D]``,
  V = ``kv[..., D:]`` of each token (``PackedKVView``);
* CPU_ATTN: each (block, head) page is a K region of N*D elements followed by a V region, and
  inside each region the CPU kernel picks its own element order per instruction set (the "vec"
  kernel stores K transposed, [D, N], and V as [N, D]). ``PagedRegionKVView`` learns that order
  once by letting vLLM's own cache-write op write a calibration block, so it reads and writes
  exactly where the kernel does, for any ISA.

Both offer ``read(slots) -> (K, V)`` and ``write(slots, K, V)`` with ``[len(slots), H, D]``
tensors, ``slot = block_id * block_size + offset``.
"""

from __future__ import annotations

import functools
from typing import Protocol

import torch

# Backends with K and V packed in the last dim of each token.
_PACKED_BACKENDS = frozenset({"FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION", "FLASHINFER",
                              "ROCM_ATTN", "ROCM_AITER_FA", "ROCM_AITER_UNIFIED_ATTN"})
_CPU_BACKENDS = frozenset({"CPU_ATTN"})


class UnsupportedKVLayout(RuntimeError):
    """This backend / tensor shape is not one we can read; the caller falls back to compute."""


class KVView(Protocol):
    block_size: int

    def read(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the given slots, each ``[len(slots), H, D]`` (a copy)."""

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``[len(slots), H, D]`` K and V into the given slots."""


def _split_slots(slots: torch.Tensor, block_size: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    slots = slots.to(device=device, dtype=torch.long)
    return slots // block_size, slots % block_size


class PackedKVView:
    """K = ``kv[..., :D]``, V = ``kv[..., D:]``; works for any stride permutation of [B,H,N,C]."""

    def __init__(self, kv_cache: torch.Tensor, head_size: int):
        self.k = kv_cache[..., :head_size]
        self.v = kv_cache[..., head_size:]
        self.block_size = kv_cache.shape[2]

    def read(self, slots):
        blocks, offsets = _split_slots(slots, self.block_size, self.k.device)
        return self.k[blocks, :, offsets], self.v[blocks, :, offsets]

    def write(self, slots, k, v):
        blocks, offsets = _split_slots(slots, self.block_size, self.k.device)
        self.k[blocks, :, offsets] = k.to(device=self.k.device, dtype=self.k.dtype)
        self.v[blocks, :, offsets] = v.to(device=self.v.device, dtype=self.v.dtype)


class PagedRegionKVView:
    """Pages of ``2 * N * D`` elements: K region then V region, each in a learned element order.

    ``k_pos[n, d]`` / ``v_pos[n, d]`` give the flat offset, inside a page's K / V region, of
    element d of the page's n-th token.
    """

    def __init__(self, kv_cache: torch.Tensor, head_size: int, k_pos: torch.Tensor,
                 v_pos: torch.Tensor):
        num_blocks, num_heads, block_size, _ = kv_cache.shape
        try:
            regions = kv_cache.view(num_blocks, num_heads, 2, block_size * head_size)
        except RuntimeError as exc:
            raise UnsupportedKVLayout("KV pages are not contiguous") from exc
        self.k_flat, self.v_flat = regions[:, :, 0], regions[:, :, 1]  # [B, H, N*D] views
        self.block_size = block_size
        self.k_pos = k_pos.to(kv_cache.device)
        self.v_pos = v_pos.to(kv_cache.device)

    def _index(self, slots, pos):
        blocks, offsets = _split_slots(slots, self.block_size, self.k_flat.device)
        return blocks[:, None], pos[offsets]  # [T, 1] and [T, D]; indexing gives [T, D, H]

    def read(self, slots):
        b, kp = self._index(slots, self.k_pos)
        _, vp = self._index(slots, self.v_pos)
        return self.k_flat[b, :, kp].transpose(1, 2), self.v_flat[b, :, vp].transpose(1, 2)

    def write(self, slots, k, v):
        b, kp = self._index(slots, self.k_pos)
        _, vp = self._index(slots, self.v_pos)
        dt, dev = self.k_flat.dtype, self.k_flat.device
        self.k_flat[b, :, kp] = k.to(device=dev, dtype=dt).transpose(1, 2)
        self.v_flat[b, :, vp] = v.to(device=dev, dtype=dt).transpose(1, 2)


@functools.lru_cache(maxsize=16)  # one calibration serves every layer of the same shape
def calibrate_cpu_pages(block_size: int, head_size: int, dtype: torch.dtype,
                        isa: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Where vLLM's CPU cache-write op puts element (n, d) of K and of V inside a page.

    Two writes of one block through ``cpu_attn_reshape_and_cache``: one with every element set to
    its token index n, one set to its dim index d (both exact in bf16 up to 256).
    """
    from vllm import _custom_ops as ops

    if max(block_size, head_size) > 256:
        raise UnsupportedKVLayout("calibration needs block_size and head_size <= 256")
    n_idx = torch.arange(block_size).view(block_size, 1, 1).expand(block_size, 1, head_size)
    d_idx = torch.arange(head_size).view(1, 1, head_size).expand(block_size, 1, head_size)
    found = []
    for fill in (n_idx, d_idx):
        page = torch.full((1, 1, 2 * block_size, head_size), -1.0, dtype=dtype)
        key_cache, value_cache = page.chunk(2, dim=2)
        src = fill.to(dtype).contiguous()
        ops.cpu_attn_reshape_and_cache(src, src.clone(), key_cache, value_cache,
                                       torch.arange(block_size, dtype=torch.long), isa)
        found.append(page.view(2, block_size * head_size).float())
    positions = []
    for region in range(2):
        n_at, d_at = found[0][region].long(), found[1][region].long()
        if (n_at < 0).any() or (d_at < 0).any():
            raise UnsupportedKVLayout(f"CPU ISA {isa!r}: cache write left holes in the page")
        pos = torch.full((block_size, head_size), -1, dtype=torch.long)
        pos[n_at, d_at] = torch.arange(block_size * head_size)
        if (pos < 0).any():
            raise UnsupportedKVLayout(f"CPU ISA {isa!r}: page order is not a permutation")
        positions.append(pos)
    return positions[0], positions[1]


def kv_view(kv_cache: torch.Tensor, backend: str, head_size: int,
            cpu_isa: str | None = None) -> KVView:
    """The (K, V) view of one layer's registered KV tensor for ``backend`` (vLLM's name)."""
    if kv_cache.dim() != 4:
        raise UnsupportedKVLayout(f"expected a 4-D [B, H, N, C] KV tensor, got {tuple(kv_cache.shape)}")
    if kv_cache.shape[3] != 2 * head_size:
        # MLA latent caches and NVFP4 head-group layouts do not split into per-token K and V.
        raise UnsupportedKVLayout(f"last dim {kv_cache.shape[3]} != 2 * head_size ({head_size})")
    name = backend.upper()
    if name in _PACKED_BACKENDS:
        return PackedKVView(kv_cache, head_size)
    if name in _CPU_BACKENDS:
        if cpu_isa is None:
            raise UnsupportedKVLayout("CPU_ATTN layer without an ISA")
        k_pos, v_pos = calibrate_cpu_pages(kv_cache.shape[2], head_size, kv_cache.dtype, cpu_isa)
        return PagedRegionKVView(kv_cache, head_size, k_pos, v_pos)
    raise UnsupportedKVLayout(f"attention backend {backend!r} has no KV view")
