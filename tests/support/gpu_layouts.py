"""vLLM 0.33's GPU KV caches (FLASH_ATTN, TRITON_ATTN, FLASHINFER) rebuilt as CPU tensors with
the same shapes, strides and sharing, for tests that run our code through them.

What 0.33 does, read from its source (paths under ``vllm/``):

* Every backend here hands the connector one logical ``[num_blocks, num_kv_heads, block_size,
  2 * head_size]`` tensor per layer, K in ``[..., :head_size]`` and V after it:
  ``v1/kv_cache_interface.py`` ``compute_layer_kv_cache_shape_bytes`` (C in bytes,
  ``(head_size + head_size_v) * dtype size``), viewed as the KV dtype in
  ``create_kv_cache_views``; read as ``kv_cache.transpose(1, 2).split(head_size, dim=-1)`` by
  ``v1/attention/backends/flash_attn.py`` (``FlashAttentionImpl.forward``) and
  ``triton_attn.py`` (``TritonAttentionImpl.forward``, ``do_kv_cache_update``), and as
  ``kv_cache.permute(*layout.layer_view_order)`` then ``.split(hs, dim=-1)`` by
  ``flashinfer.py`` (``FlashInferImpl.forward``).
* The memory order is one ``KVCacheLayout`` (``v1/kv_cache_layout.py``): a permutation of the
  logical ``[L, B, H, N, C]`` whose name spells the physical order, outermost first. All layers
  live in ONE flat int8 buffer: ``v1/worker/utils.py`` ``allocate_kv_cache`` views it through
  ``create_kv_cache_views`` (a 5-D ``torch.as_strided``, then one ``[B, H, N, C]`` view per
  layer). Both GPU runners allocate through it (V1: ``gpu_model_runner.py``
  ``initialize_kv_cache_tensors``; V2: ``v1/worker/gpu/attn_utils.py`` ``init_kv_cache``) and
  hand those views to ``register_kv_caches``. The layer and block strides come from
  ``v1/core/kv_cache_planning.py`` ``get_kv_cache_config_from_groups``: layer-outer layouts
  (``L`` first) give each layer its own region, block-outer ones (``B`` first) interleave the
  layers inside every block.
* Which layout runs: ``v1/attention/backends/utils.py`` ``resolve_kv_cache_layout``:
  ``VLLM_KV_CACHE_LAYOUT`` (the legacy names ``NHD`` and ``HND`` alias ``LBNHC`` and ``LBHNC``),
  the connector's ``get_required_kvcache_layout``, the backends' ``supported_kv_cache_layouts``,
  else ``_DEFAULT_LAYOUT_PREFERENCE`` (``LBNHC`` first).

0.33 has no per-backend ``get_kv_cache_shape`` / ``get_kv_cache_stride_order`` nor a
``get_kv_cache_layout()`` any more (older releases had them): the shape is common and the stride
order is the layout, so the table below is backend -> the layouts 0.33 runs it with.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

ALL_LAYOUTS = ("LBNHC", "LBHNC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
DEFAULT_LAYOUT = "LBNHC"  # _DEFAULT_LAYOUT_PREFERENCE[0]; the legacy "NHD"
LEGACY_NAMES = {"LBNHC": "NHD", "LBHNC": "HND"}


def reads_transposed(cache: torch.Tensor, layout: str, head_size: int):
    """FLASH_ATTN's and TRITON_ATTN's own view of a layer: ``kv_cache.transpose(1, 2)
    .split(head_size, dim=-1)``, K and V indexed [block, token, head, dim]."""
    k, v = cache.transpose(1, 2).split(head_size, dim=-1)
    return k, v, "BNHD"


def reads_layer_view_order(cache: torch.Tensor, layout: str, head_size: int):
    """FLASHINFER's: the layer permuted to its physical order (``layout.layer_view_order``,
    the layout's name without L) before ``.split(hs, dim=-1)``; the axes come out in that
    order (HND or NHD inside a block)."""
    order = [a for a in layout if a != "L"]
    k, v = cache.permute(*["BHNC".index(a) for a in order]).split(head_size, dim=-1)
    return k, v, "".join(order).replace("C", "D")


@dataclass(frozen=True)
class GpuBackend:
    name: str  # the backend's get_name(), what the worker reads off each attention layer
    layouts: tuple[str, ...]  # the KVCacheLayouts 0.33 can run it with
    reads: Callable  # (layer cache, layout, head_size) -> K, V and their axes, as it reads them
    source: str  # where 0.33 says so


GPU_BACKENDS = (
    GpuBackend(
        "FLASH_ATTN",
        ALL_LAYOUTS,
        reads_transposed,
        "flash_attn.py FlashAttentionBackend declares no supported_kv_cache_layouts: the base "
        "AttentionBackend's (v1/attention/backend.py) returns None, any layout",
    ),
    GpuBackend(
        "TRITON_ATTN",
        ALL_LAYOUTS,
        reads_transposed,
        "triton_attn.py TritonAttentionBackend: likewise none declared; its kernels take the "
        "view's strides (_ensure_scale_caches: 'may have HND or NHD physical strides')",
    ),
    GpuBackend(
        "FLASHINFER",
        ("LBNHC", "LBHNC", "BLHNC", "BLNHC", "BHLNC"),
        reads_layer_view_order,
        "flashinfer.py FlashInferBackend.supported_kv_cache_layouts: None (any) except on "
        "SM100, (LBHNC, BLHNC); utils.py get_flashinfer_layout_string names only these five "
        "(LHBNC has no FlashInfer NHD/HND equivalent and asserts there)",
    ),
)

# One case per (backend, layout) 0.33 can run.
CASES = [(b.name, layout) for b in GPU_BACKENDS for layout in b.layouts]
BACKENDS = {b.name: b for b in GPU_BACKENDS}


def case_id(backend: str, layout: str) -> str:
    legacy = LEGACY_NAMES.get(layout)
    return f"{backend}-{layout}" + (f"({legacy})" if legacy else "")


CASE_IDS = [case_id(b, lay) for b, lay in CASES]


def layout_strides(layout: str, shape: dict[str, int]) -> dict[str, int]:
    """Strides (in units of the innermost axis) of each logical axis when memory holds the axes
    in ``layout``'s order, outermost first (a dense buffer, as vLLM allocates it)."""
    strides, step = {}, 1
    for axis in reversed(layout):
        strides[axis] = step
        step *= shape[axis]
    return strides


def vllm_kv_caches(
    layout: str,
    layer_names: list[str] | tuple[str, ...],
    num_blocks: int,
    num_kv_heads: int,
    block_size: int,
    head_size: int,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
) -> dict[str, torch.Tensor]:
    """The per-layer ``[B, H, N, 2 * head_size]`` views 0.33 would register for one attention
    group laid out as ``layout``: byte strides over one int8 buffer, then each layer's view
    retyped as ``dtype`` (so element strides are byte strides / itemsize). ``device``: on a lent
    GPU, the buffer lives there, as vLLM's does."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    shape = {
        "L": len(layer_names),
        "B": num_blocks,
        "H": num_kv_heads,
        "N": block_size,
        "C": 2 * head_size * itemsize,
    }
    strides = layout_strides(layout, shape)
    raw = torch.zeros(
        shape["L"] * shape["B"] * shape["H"] * shape["N"] * shape["C"],
        dtype=torch.int8,
        device=device,
    )
    logical = "LBHNC"
    view = raw.as_strided([shape[a] for a in logical], [strides[a] for a in logical])
    return {name: view[i].view(dtype) for i, name in enumerate(layer_names)}


def fill(caches, seed: int = 0) -> None:
    """Random K/V in every element of every layer (written through the views)."""
    g = torch.Generator().manual_seed(seed)
    for cache in caches:
        cache.copy_(torch.randn(cache.shape, generator=g).to(cache.dtype))
