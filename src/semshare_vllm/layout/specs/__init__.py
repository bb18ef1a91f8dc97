"""One ``PageSpec`` per KV page layout the connector supports (``base.py`` says what a spec
offers): ``packed.py`` (K|V in each token's last dim), ``cpu_attn.py`` (CPU_ATTN's K region then
V region, in a learnt order) and ``whole_pages.py`` (anything else: whole-block copies only).
``page_spec`` picks one by vLLM's backend name; ``offsets.py`` is the table the kernels take.
"""

from __future__ import annotations

from .base import PageSpec, UnsupportedKVLayout
from .cpu_attn import CpuAttnSpec, calibrate_cpu_pages
from .offsets import PageOffsets
from .packed import PackedKVSpec
from .whole_pages import WholePagesSpec

# Backends with K and V packed in the last dim of each token.
_PACKED_BACKENDS = frozenset(
    {
        "FLASH_ATTN",
        "TRITON_ATTN",
        "FLEX_ATTENTION",
        "FLASHINFER",
        "ROCM_ATTN",
        "ROCM_AITER_FA",
        "ROCM_AITER_UNIFIED_ATTN",
    }
)
_CPU_BACKENDS = frozenset({"CPU_ATTN"})


def page_spec(backend: str, head_size: int, cpu_isa: str | None = None) -> PageSpec:
    """The spec of ``backend``'s pages (vLLM's backend name). Never raises: a layout we cannot
    read by token fails at ``check`` or at first use, since quantised KV is moved as whole pages
    only and needs no more."""
    name = backend.upper()
    if name in _PACKED_BACKENDS:
        return PackedKVSpec(backend, head_size, cpu_isa)
    if name in _CPU_BACKENDS:
        return CpuAttnSpec(backend, head_size, cpu_isa)
    return WholePagesSpec(backend, head_size, cpu_isa)


__all__ = [
    "CpuAttnSpec",
    "PackedKVSpec",
    "PageOffsets",
    "PageSpec",
    "UnsupportedKVLayout",
    "WholePagesSpec",
    "calibrate_cpu_pages",
    "page_spec",
]
