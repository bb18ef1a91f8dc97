"""CPU_ATTN pages: each (block, head) page is a K region of N*D elements followed by a V region,
and inside each region vLLM's CPU kernel picks its own element order per instruction set (the
"vec" kernel stores K transposed, [D, N], and V as [N, D]). The order is learnt once per
(block size, head size, dtype, ISA) by letting vLLM's own cache-write op write a calibration
block, so reads and writes land exactly where the kernel's do, for any ISA.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from semshare_vllm.vllm_compat import cpu_attention

from .base import PageSpec, UnsupportedKVLayout, split_slots
from .offsets import PageOffsets


@dataclass(frozen=True)
class CpuAttnSpec(PageSpec):
    # ``(k_pos, v_pos)``: ``k_pos[n, d]`` is the flat offset, inside a page's K region, of
    # element d of the page's n-th token (``v_pos`` likewise). None: learnt by calibration for
    # ``cpu_isa``; given: some other kernel's order (and the tests' arbitrary permutations).
    positions: tuple[torch.Tensor, torch.Tensor] | None = field(
        default=None, compare=False, repr=False
    )

    def _tables(self, kv_cache: torch.Tensor):
        """``(k_pos, k_order), (v_pos, v_order)`` for pages shaped like ``kv_cache``."""
        if self.positions is not None:
            return tuple((pos, _page_order(pos)) for pos in self.positions)
        if self.cpu_isa is None:
            raise UnsupportedKVLayout("CPU_ATTN layer without an ISA")
        return _calibrated(kv_cache.shape[2], self.head_size, kv_cache.dtype, self.cpu_isa)

    def check(self, kv_cache: torch.Tensor) -> None:
        self._regions(kv_cache)  # also learns the order: a kernel we cannot calibrate fails here

    def _regions(self, kv_cache: torch.Tensor):
        """The ``[B, H, N*D]`` K and V regions and, per region, its position table and order."""
        super().check(kv_cache)
        num_blocks, num_heads, block_size, _ = kv_cache.shape
        (k_pos, k_order), (v_pos, v_order) = self._tables(kv_cache)
        try:
            regions = kv_cache.view(num_blocks, num_heads, 2, block_size * self.head_size)
        except RuntimeError as exc:
            raise UnsupportedKVLayout("KV pages are not contiguous") from exc
        dev = kv_cache.device
        return (
            (regions[:, :, 0], k_pos.to(dev), k_order),
            (regions[:, :, 1], v_pos.to(dev), v_order),
        )

    def offsets(self, kv_cache: torch.Tensor) -> PageOffsets:
        self.check(kv_cache)
        (k_pos, _), (v_pos, _) = self._tables(kv_cache)
        channels = kv_cache.shape[3]
        if kv_cache.stride(2) != channels * kv_cache.stride(3):
            raise UnsupportedKVLayout("KV pages are not contiguous")
        region = kv_cache.shape[2] * self.head_size
        step = kv_cache.stride(3)
        return PageOffsets.build(kv_cache, k_pos.long() * step, (region + v_pos.long()) * step)

    def read(self, kv_cache, slots):
        out = []
        for flat, pos, _ in self._regions(kv_cache):
            blocks, offsets = split_slots(slots, kv_cache.shape[2], flat.device)
            # [T, 1] blocks and [T, D] positions index a [T, D, H] result
            out.append(flat[blocks[:, None], :, pos[offsets]].transpose(1, 2))
        return out[0], out[1]

    def write(self, kv_cache, slots, k, v):
        for (flat, pos, _), src in zip(self._regions(kv_cache), (k, v)):
            blocks, offsets = split_slots(slots, kv_cache.shape[2], flat.device)
            flat[blocks[:, None], :, pos[offsets]] = src.to(
                device=flat.device, dtype=flat.dtype
            ).transpose(1, 2)

    def read_blocks(self, kv_cache, blocks):
        block_size = kv_cache.shape[2]
        blocks = blocks.to(kv_cache.device)
        out = []
        for flat, _, order in self._regions(kv_cache):
            # [b, H, N*D] in the kernel's order (index_select: ~5x faster than flat[blocks]
            # on CPU)
            pages = flat.index_select(0, blocks)
            if isinstance(order, torch.Tensor):  # any other permutation: gather token-major
                pages = pages.index_select(2, order.flatten().to(pages.device))
                order = "nd"
            if order == "nd":
                tokens = pages.unflatten(2, (block_size, -1)).transpose(1, 2)
            else:  # "dn": the page is K transposed
                tokens = pages.unflatten(2, (-1, block_size)).permute(0, 3, 1, 2)
            out.append(tokens.flatten(0, 1))
        return out[0], out[1]

    def write_blocks(self, kv_cache, blocks, k, v):
        block_size = kv_cache.shape[2]
        blocks = blocks.to(kv_cache.device)
        for (flat, _, order), src in zip(self._regions(kv_cache), (k, v)):
            src = src.to(device=flat.device, dtype=flat.dtype).unflatten(0, (-1, block_size))
            if isinstance(order, str) and order == "dn":
                pages = src.permute(0, 2, 3, 1).flatten(2)  # [b, H, D*N]
            else:
                pages = src.transpose(1, 2).flatten(2)  # [b, H, N*D] token-major
                if isinstance(order, torch.Tensor):
                    order = order.flatten().to(pages.device)
                    pages = pages.index_select(2, torch.argsort(order))
            flat[blocks] = pages


@functools.lru_cache(maxsize=16)
def _calibrated(block_size: int, head_size: int, dtype: torch.dtype, isa: str):
    """The calibrated tables with their orders, worked out once per page shape."""
    return tuple(
        (pos, _page_order(pos)) for pos in calibrate_cpu_pages(block_size, head_size, dtype, isa)
    )


def _page_order(pos: torch.Tensor):
    """'nd' (token rows), 'dn' (transposed), or the position table itself for anything else
    (block reads and writes then gather through it)."""
    n, d = pos.shape
    nn, dd = torch.meshgrid(torch.arange(n), torch.arange(d), indexing="ij")
    if torch.equal(pos.cpu(), nn * d + dd):
        return "nd"
    if torch.equal(pos.cpu(), dd * n + nn):
        return "dn"
    return pos


@functools.lru_cache(maxsize=16)  # one calibration serves every layer of the same shape
def calibrate_cpu_pages(
    block_size: int, head_size: int, dtype: torch.dtype, isa: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where vLLM's CPU cache-write op puts element (n, d) of K and of V inside a page.

    Two writes of one block through ``cpu_attn_reshape_and_cache``: one with every element set to
    its token index n, one set to its dim index d (both exact in bf16 up to 256).
    """
    if max(block_size, head_size) > 256:
        raise UnsupportedKVLayout("calibration needs block_size and head_size <= 256")
    n_idx = torch.arange(block_size).view(block_size, 1, 1).expand(block_size, 1, head_size)
    d_idx = torch.arange(head_size).view(1, 1, head_size).expand(block_size, 1, head_size)
    found = []
    for fill in (n_idx, d_idx):
        page = torch.full((1, 1, block_size, 2 * head_size), -1.0, dtype=dtype)  # one block
        src = fill.to(dtype).contiguous()
        cpu_attention.write_kv(
            page, src, src.clone(), torch.arange(block_size, dtype=torch.long), isa
        )
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
