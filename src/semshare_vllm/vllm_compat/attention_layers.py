"""The attention layers vLLM built for this engine, as the worker needs them when its KV caches
are registered: each layer's backend, CPU ISA, the KV-cache views bound to it, and the kernel
block sizes its backend declares.

Touches ``vllm_config.compilation_config.static_forward_context`` (layer name -> ``Attention``
module) and, on each layer: ``attn_backend`` (``get_name()``,
``get_supported_kernel_block_sizes()``, whose entries are ints or ``MultipleOf``), ``isa`` (set
on every layer by the CPU_ATTN metadata builder; ``impl.isa`` where a build keeps it on the
impl) and ``kv_cache`` (the view vLLM binds, which is a kernel-block view where the backend
splits the scheduler's blocks, ``map_kv_caches_to_kernel_blocks``; a list per virtual engine on
older builds). Written against vLLM 0.32 (CPU_ATTN); 0.33's source has the same attributes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KernelBlockSizes:
    """The block sizes a backend's kernels take: any of ``fixed``, or any multiple of one of
    ``multiples_of``."""

    fixed: tuple[int, ...] = ()
    multiples_of: tuple[int, ...] = ()

    def accepts(self, block_size: int) -> bool:
        """True also when the backend declares nothing."""
        if not self.fixed and not self.multiples_of:
            return True
        return block_size in self.fixed or any(block_size % m == 0 for m in self.multiples_of)


@dataclass(frozen=True, eq=False)  # holds tensors: compare by identity
class AttentionLayer:
    backend: str  # vLLM's backend name; "?" for a layer vLLM did not build
    cpu_isa: str | None  # CPU_ATTN's kernel ISA ("vec", "amx", ...), else None
    kv_cache_views: tuple[torch.Tensor, ...]  # the non-empty 4-D views bound to the layer
    kernel_block_sizes: KernelBlockSizes | None  # None: the backend's are not reachable


def attention_layers(vllm_config, layer_names) -> dict[str, AttentionLayer]:
    """Each of ``layer_names`` as vLLM built it. Raises where a layer's backend has no name
    (the worker then turns itself off)."""
    forward_ctx = vllm_config.compilation_config.static_forward_context
    return {name: _layer(forward_ctx.get(name)) for name in layer_names}


def _layer(layer) -> AttentionLayer:
    if layer is None:
        return AttentionLayer("?", None, (), None)
    isa = getattr(layer, "isa", None) or getattr(getattr(layer, "impl", None), "isa", None)
    bound = getattr(layer, "kv_cache", None)
    views = tuple(
        t
        for t in (bound if isinstance(bound, (list, tuple)) else [bound])
        if isinstance(t, torch.Tensor) and t.dim() == 4 and t.numel()
    )
    return AttentionLayer(
        layer.attn_backend.get_name(), isa, views, _kernel_block_sizes(layer.attn_backend)
    )


def _kernel_block_sizes(backend) -> KernelBlockSizes | None:
    try:
        sizes = list(backend.get_supported_kernel_block_sizes())
    except Exception:  # not reachable without the layer's spec
        return None
    return KernelBlockSizes(
        fixed=tuple(s for s in sizes if isinstance(s, int)),
        # MultipleOf(base); anything else we cannot read takes every size (base 1)
        multiples_of=tuple(getattr(s, "base", 1) for s in sizes if not isinstance(s, int)),
    )
