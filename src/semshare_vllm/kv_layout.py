"""(K, V) views of one layer's paged KV tensor, one implementation per attention backend.

vLLM 0.32/0.33 hands a connector one logical ``[num_blocks, num_kv_heads, block_size, C]``
tensor per layer, C = 2 * head_size, but backends read it differently:

* packed (FLASH_ATTN, TRITON_ATTN, FLEX_ATTENTION, FlashInfer): K = ``kv[..., :D]``,
  V = ``kv[..., D:]`` for each token;
* CPU_ATTN: each (block, head) page is N rows of K followed by N rows of V, i.e.
  ``kv.view(B, H, 2N, D)`` split at row N.

Both give K and V as ``[B, H, N, D]`` views of the same storage, so reads and writes by slot
(``slot = block_id * N + offset``) are the same code for every backend.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Backends whose pages hold K rows then V rows.
_ROW_SPLIT_BACKENDS = frozenset({"CPU_ATTN", "TORCH_SDPA"})
# Backends with K and V packed in the last dim of each token.
_PACKED_BACKENDS = frozenset({"FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION", "FLASHINFER",
                              "ROCM_ATTN", "ROCM_AITER_FA", "ROCM_AITER_UNIFIED_ATTN"})


class UnsupportedKVLayout(RuntimeError):
    """This backend / tensor shape is not one we can read; the caller falls back to compute."""


@dataclass(frozen=True)
class KVView:
    """K and V of one layer as ``[num_blocks, num_kv_heads, block_size, head_size]`` views."""

    k: torch.Tensor
    v: torch.Tensor

    @property
    def block_size(self) -> int:
        return self.k.shape[2]

    def _index(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        slots = slots.to(device=self.k.device, dtype=torch.long)
        return slots // self.block_size, slots % self.block_size

    def read(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the given slots, each ``[len(slots), H, D]`` (a copy)."""
        blocks, offsets = self._index(slots)
        return self.k[blocks, :, offsets], self.v[blocks, :, offsets]

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``[len(slots), H, D]`` K and V into the given slots."""
        blocks, offsets = self._index(slots)
        self.k[blocks, :, offsets] = k.to(device=self.k.device, dtype=self.k.dtype)
        self.v[blocks, :, offsets] = v.to(device=self.v.device, dtype=self.v.dtype)


def kv_view(kv_cache: torch.Tensor, backend: str, head_size: int) -> KVView:
    """The (K, V) view of one layer's registered KV tensor for ``backend`` (vLLM's name)."""
    if kv_cache.dim() != 4:
        raise UnsupportedKVLayout(f"expected a 4-D [B, H, N, C] KV tensor, got {tuple(kv_cache.shape)}")
    num_blocks, num_heads, block_size, width = kv_cache.shape
    if width != 2 * head_size:
        # MLA latent caches and NVFP4 head-group layouts do not split into per-token K and V.
        raise UnsupportedKVLayout(f"last dim {width} != 2 * head_size ({head_size})")
    name = backend.upper()
    if name in _PACKED_BACKENDS:
        return KVView(kv_cache[..., :head_size], kv_cache[..., head_size:])
    if name in _ROW_SPLIT_BACKENDS:
        try:
            pages = kv_cache.view(num_blocks, num_heads, 2 * block_size, head_size)
        except RuntimeError as exc:  # a stride permutation that CPU_ATTN itself could not read
            raise UnsupportedKVLayout(f"{backend}: KV tensor is not page-contiguous") from exc
        return KVView(pages[:, :, :block_size], pages[:, :, block_size:])
    raise UnsupportedKVLayout(f"attention backend {backend!r} has no KV view")
