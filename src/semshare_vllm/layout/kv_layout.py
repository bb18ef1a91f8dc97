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

A ``PageLayout`` names one of these layouts, so that donor KV kept as pages copied out of the
cache (``[blocks, H, N, C]``, the cheapest capture: one block gather) can be read by token with
the same code as the cache itself, and copied back whole block by whole block (``copy_tokens``).

Both views offer ``read(slots) -> (K, V)`` and ``write(slots, K, V)`` with ``[len(slots), H, D]``
tensors, ``slot = block_id * block_size + offset``, and the same for whole blocks
(``read_blocks`` / ``write_blocks``: whole-page reshapes, ~4x faster than slot gathers on CPU).
``read_range`` and ``write_range`` move a run of token positions, whole blocks the fast way.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Protocol

import torch

from semshare_vllm.vllm_compat import cpu_attention

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

    def read_blocks(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of every token of the given blocks, ``[len(blocks) * N, H, D]`` each."""

    def write_blocks(self, blocks: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Fill whole blocks from ``[len(blocks) * N, H, D]`` K and V."""


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

    def read_blocks(self, blocks):
        blocks = blocks.to(self.k.device)
        return tuple(x[blocks].transpose(1, 2).flatten(0, 1) for x in (self.k, self.v))

    def write_blocks(self, blocks, k, v):
        blocks = blocks.to(self.k.device)
        for dst, src in ((self.k, k), (self.v, v)):
            pages = src.to(device=dst.device, dtype=dst.dtype).unflatten(0, (-1, self.block_size))
            dst[blocks] = pages.transpose(1, 2)


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
        self._orders = tuple(_page_order(p) for p in (self.k_pos, self.v_pos))

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

    def read_blocks(self, blocks):
        blocks = blocks.to(self.k_flat.device)
        out = []
        for flat, order in zip((self.k_flat, self.v_flat), self._orders):
            pages = flat[blocks]  # [b, H, N*D] in the kernel's order
            if isinstance(order, torch.Tensor):  # any other permutation: gather token-major
                pages = pages.index_select(2, order.flatten())
                order = "nd"
            if order == "nd":
                tokens = pages.unflatten(2, (self.block_size, -1)).transpose(1, 2)
            else:  # "dn": the page is K transposed
                tokens = pages.unflatten(2, (-1, self.block_size)).permute(0, 3, 1, 2)
            out.append(tokens.flatten(0, 1))
        return out[0], out[1]

    def write_blocks(self, blocks, k, v):
        blocks = blocks.to(self.k_flat.device)
        for flat, order, src in zip((self.k_flat, self.v_flat), self._orders, (k, v)):
            src = src.to(device=flat.device, dtype=flat.dtype).unflatten(0, (-1, self.block_size))
            if order == "dn":
                pages = src.permute(0, 2, 3, 1).flatten(2)  # [b, H, D*N]
            else:
                pages = src.transpose(1, 2).flatten(2)  # [b, H, N*D] token-major
                if isinstance(order, torch.Tensor):
                    pages = pages.index_select(2, torch.argsort(order.flatten()))
            flat[blocks] = pages


def _page_order(pos: torch.Tensor):
    """'nd' (token rows), 'dn' (transposed), or the position table itself for anything else."""
    n, d = pos.shape
    nn, dd = torch.meshgrid(torch.arange(n), torch.arange(d), indexing="ij")
    if torch.equal(pos.cpu(), nn * d + dd):
        return "nd"
    if torch.equal(pos.cpu(), dd * n + nn):
        return "dn"
    return pos


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
        ids = block_ids[head_end // block_size: body_end // block_size]
        pieces.append((head_end, body_end, torch.as_tensor(ids, dtype=torch.long)))
    if end > body_end:
        pieces.append((body_end, end, None))
    return pieces


def slots_for(block_ids: list[int], start: int, stop: int, block_size: int) -> torch.Tensor:
    """Paged-cache slot of each token position in ``[start, stop)``."""
    pos = torch.arange(start, stop, dtype=torch.long)
    blocks = torch.as_tensor(block_ids, dtype=torch.long)[pos // block_size]
    return blocks * block_size + pos % block_size


def read_range(view: KVView, block_ids: list[int], start: int,
               num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V (``[num_tokens, H, D]``) of positions ``[start, start + num_tokens)`` of a request
    whose blocks are ``block_ids``."""
    ks, vs = [], []
    for first, stop, whole in _runs(block_ids, start, num_tokens, view.block_size):
        k, v = (view.read_blocks(whole) if whole is not None
                else view.read(slots_for(block_ids, first, stop, view.block_size)))
        ks.append(k)
        vs.append(v)
    return torch.cat(ks), torch.cat(vs)


def write_range(view: KVView, block_ids: list[int], start: int, k: torch.Tensor,
                v: torch.Tensor) -> None:
    """Write ``[T, H, D]`` K and V into positions ``[start, start + T)``."""
    for first, stop, whole in _runs(block_ids, start, k.shape[0], view.block_size):
        kk, vv = k[first - start:stop - start], v[first - start:stop - start]
        if whole is not None:
            view.write_blocks(whole, kk, vv)
        else:
            view.write(slots_for(block_ids, first, stop, view.block_size), kk, vv)


@functools.lru_cache(maxsize=16)  # one calibration serves every layer of the same shape
def calibrate_cpu_pages(block_size: int, head_size: int, dtype: torch.dtype,
                        isa: str) -> tuple[torch.Tensor, torch.Tensor]:
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
        cpu_attention.write_kv(page, src, src.clone(), torch.arange(block_size, dtype=torch.long),
                               isa)
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
        raise UnsupportedKVLayout(
            f"expected a 4-D [B, H, N, C] KV tensor, got {tuple(kv_cache.shape)}")
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


@dataclass(frozen=True)
class PageLayout:
    """One backend's page layout; ``name`` is recorded with persisted donors."""

    backend: str
    head_size: int
    cpu_isa: str | None = None

    @property
    def name(self) -> str:
        return f"{self.backend}/{self.cpu_isa or '-'}/{self.head_size}"

    def view(self, pages: torch.Tensor) -> KVView:
        return kv_view(pages, self.backend, self.head_size, cpu_isa=self.cpu_isa)


def copy_tokens(src: torch.Tensor, src_blocks: list[int], src_start: int, dst: torch.Tensor,
                dst_blocks: list[int], dst_start: int, num_tokens: int,
                layout: PageLayout) -> None:
    """Copy the KV of ``num_tokens`` positions between two stacks of page tensors of the same
    layout, ``[layers, blocks, H, N, C]`` (the paged cache, or donor pages): whole blocks as raw
    pages when both ranges start on a block boundary, anything else token by token through
    ``layout``'s view."""
    bs = dst.shape[3]
    done = 0
    if src_start % bs == 0 and dst_start % bs == 0 and num_tokens >= bs:
        whole = num_tokens // bs
        s0, d0 = src_start // bs, dst_start // bs
        copy_blocks(src, src_blocks[s0:s0 + whole], dst, dst_blocks[d0:d0 + whole])
        done = whole * bs
    if done < num_tokens:
        for src_layer, dst_layer in zip(src, dst):
            k, v = read_range(layout.view(src_layer), src_blocks, src_start + done,
                              num_tokens - done)
            write_range(layout.view(dst_layer), dst_blocks, dst_start + done, k, v)


def copy_blocks(src: torch.Tensor, src_blocks: list[int], dst: torch.Tensor,
                dst_blocks: list[int]) -> None:
    """``dst[:, d] = src[:, s]`` for each block pair: one copy per block, all layers at once.
    No gathered temporary: on CPU a fresh multi-MB temporary costs more in page faults than the
    copy itself."""
    for s, d in zip(src_blocks, dst_blocks):
        dst[:, d].copy_(src[:, s], non_blocking=True)


def stack_layers(caches: list[torch.Tensor]) -> list[tuple[slice, torch.Tensor]]:
    """The per-layer KV tensors as ``[layers, blocks, H, N, C]`` stacks, for copies that move
    every layer in one op (vLLM allocates all layers in one buffer, at a uniform stride, so this
    is usually a single view); falls back to one stack per layer."""
    first = caches[0]
    uniform = len(caches) > 1 and all(
        c.shape == first.shape and c.stride() == first.stride() and c.dtype == first.dtype
        and c.device == first.device
        and c.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        for c in caches)
    if uniform:
        step = caches[1].storage_offset() - first.storage_offset()
        if step >= first.numel() and all(
                c.storage_offset() - first.storage_offset() == i * step
                for i, c in enumerate(caches)):
            stacked = torch.as_strided(first, (len(caches), *first.shape),
                                       (step, *first.stride()), first.storage_offset())
            return [(slice(0, len(caches)), stacked)]
    return [(slice(i, i + 1), c.unsqueeze(0)) for i, c in enumerate(caches)]
