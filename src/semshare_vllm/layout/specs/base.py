"""``PageSpec``: what one attention backend's page layout means, for every reader and writer.

vLLM hands a connector one logical ``[num_blocks, num_kv_heads, block_size, C]`` tensor per
layer, C = 2 * head_size, but backends put K and V of a token in different places. A spec is
the one description of a layout that both users need:

* the kernels (``kernels.gather_rearrange`` / ``stage_rows``) take ``spec.offsets(kv_cache)``,
  a ``PageOffsets`` table of where each (block, offset, head) element sits;
* exact loads, captures and the layer runner read and write K and V by slot
  (``read`` / ``write``), by whole block (``read_blocks`` / ``write_blocks``: whole-page
  reshapes, much faster than slot gathers on CPU) and by token range (``read_range`` /
  ``write_range``), and copy runs of tokens (``copy_tokens``) or raw blocks (``copy_blocks``)
  between a cache and donor pages of the same layout.

Tensors are passed to each call, so one spec serves every layer, the cache and a host pool
alike. ``K`` and ``V`` are ``[len(slots), H, D]``, ``slot = block_id * block_size + offset``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..paged_cache import slots_for

if TYPE_CHECKING:
    from .offsets import PageOffsets


class UnsupportedKVLayout(RuntimeError):
    """This backend / tensor shape is not one we can read; the caller falls back to compute."""


@dataclass(frozen=True)
class PageSpec(ABC):
    """One backend's page layout; ``name`` is recorded with persisted donors."""

    backend: str
    head_size: int
    cpu_isa: str | None = None

    @property
    def name(self) -> str:
        return f"{self.backend}/{self.cpu_isa or '-'}/{self.head_size}"

    def check(self, kv_cache: torch.Tensor) -> None:
        """Raise ``UnsupportedKVLayout`` unless ``kv_cache`` can be read by token this way."""
        if kv_cache.dim() != 4:
            raise UnsupportedKVLayout(
                f"expected a 4-D [B, H, N, C] KV tensor, got {tuple(kv_cache.shape)}"
            )
        if kv_cache.shape[3] != 2 * self.head_size:
            # MLA latent caches and NVFP4 head-group layouts do not split into per-token K, V.
            raise UnsupportedKVLayout(
                f"last dim {kv_cache.shape[3]} != 2 * head_size ({self.head_size})"
            )

    @abstractmethod
    def offsets(self, kv_cache: torch.Tensor) -> PageOffsets:
        """Where each K / V element of tensors shaped and strided like ``kv_cache`` sits."""

    @abstractmethod
    def read(
        self, kv_cache: torch.Tensor, slots: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the given slots, each ``[len(slots), H, D]`` (a copy)."""

    @abstractmethod
    def write(
        self, kv_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Write ``[len(slots), H, D]`` K and V into the given slots."""

    @abstractmethod
    def read_blocks(
        self, kv_cache: torch.Tensor, blocks: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of every token of the given blocks, ``[len(blocks) * N, H, D]`` each (a
        copy: callers change it in place)."""

    @abstractmethod
    def write_blocks(
        self, kv_cache: torch.Tensor, blocks: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Fill whole blocks from ``[len(blocks) * N, H, D]`` K and V."""

    def read_range(
        self, kv_cache: torch.Tensor, block_ids: list[int], start: int, num_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V (``[num_tokens, H, D]``) of positions ``[start, start + num_tokens)`` of a
        request whose blocks are ``block_ids``: whole blocks the fast way, the rest by slot."""
        bs = kv_cache.shape[2]
        ks, vs = [], []
        for first, stop, whole in _runs(block_ids, start, num_tokens, bs):
            k, v = (
                self.read_blocks(kv_cache, whole)
                if whole is not None
                else self.read(kv_cache, slots_for(block_ids, first, stop, bs))
            )
            ks.append(k)
            vs.append(v)
        if len(ks) == 1:  # one piece: no concatenating copy
            return ks[0], vs[0]
        return torch.cat(ks), torch.cat(vs)

    def write_range(
        self,
        kv_cache: torch.Tensor,
        block_ids: list[int],
        start: int,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        """Write ``[T, H, D]`` K and V into positions ``[start, start + T)``."""
        bs = kv_cache.shape[2]
        for first, stop, whole in _runs(block_ids, start, k.shape[0], bs):
            kk, vv = k[first - start : stop - start], v[first - start : stop - start]
            if whole is not None:
                self.write_blocks(kv_cache, whole, kk, vv)
            else:
                self.write(kv_cache, slots_for(block_ids, first, stop, bs), kk, vv)

    def copy_tokens(
        self,
        src: torch.Tensor,
        src_blocks: list[int],
        src_start: int,
        dst: torch.Tensor,
        dst_blocks: list[int],
        dst_start: int,
        num_tokens: int,
    ) -> None:
        """Copy the KV of ``num_tokens`` positions between two stacks of page tensors of this
        layout, ``[layers, blocks, H, N, C]`` (the paged cache, or donor pages): whole blocks as
        raw pages when both ranges start on a block boundary, anything else token by token."""
        bs = dst.shape[3]
        done = 0
        if src_start % bs == 0 and dst_start % bs == 0 and num_tokens >= bs:
            whole = num_tokens // bs
            s0, d0 = src_start // bs, dst_start // bs
            self.copy_blocks(src, src_blocks[s0 : s0 + whole], dst, dst_blocks[d0 : d0 + whole])
            done = whole * bs
        if done < num_tokens:
            for src_layer, dst_layer in zip(src, dst):
                k, v = self.read_range(src_layer, src_blocks, src_start + done, num_tokens - done)
                self.write_range(dst_layer, dst_blocks, dst_start + done, k, v)

    def copy_blocks(
        self, src: torch.Tensor, src_blocks: list[int], dst: torch.Tensor, dst_blocks: list[int]
    ) -> None:
        """``dst[:, d] = src[:, s]`` for each block pair of two ``[layers, blocks, H, N, C]``
        stacks: raw pages, so the same for every layout (quantised KV included). One copy per
        block, all layers at once, no gathered temporary: on CPU a fresh multi-MB temporary
        costs more in page faults than the copy itself."""
        for s, d in zip(src_blocks, dst_blocks):
            dst[:, d].copy_(src[:, s], non_blocking=True)


def _runs(block_ids: list[int], start: int, num_tokens: int, block_size: int):
    """Split positions [start, start + num_tokens) into (first, stop, whole_blocks) pieces:
    whole_blocks is a tensor of block ids when the piece is made of whole blocks, else None."""
    end = start + num_tokens
    head_end = min(end, -(-start // block_size) * block_size)
    body_end = max(head_end, end // block_size * block_size)
    pieces = []
    if head_end > start:
        pieces.append((start, head_end, None))
    if body_end > head_end:
        ids = block_ids[head_end // block_size : body_end // block_size]
        pieces.append((head_end, body_end, torch.as_tensor(ids, dtype=torch.long)))
    if end > body_end:
        pieces.append((body_end, end, None))
    return pieces


def split_slots(slots: torch.Tensor, block_size: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Block ids and in-block offsets of ``slots``, on ``device``."""
    slots = slots.to(device=device, dtype=torch.long)
    return slots // block_size, slots % block_size
