"""A loaded vLLM model's decoder stack, as the selective recompute drives it layer by layer.

Touches: the model's class name (``SUPPORTED_ARCHITECTURES``: the Llama decoder structure);
``model.model`` with ``layers``, ``embed_input_ids``, ``norm`` (vLLM's ``RMSNorm``, called as
``norm(hidden, residual) -> (out, residual)``) and ``start_layer`` / ``end_layer`` (pipeline
stages); each decoder layer's call ``layer(positions, hidden, residual) -> (hidden, residual)``
and its ``self_attn.attn``, a vLLM ``Attention`` (``layer_name``, ``num_heads``,
``num_kv_heads``, ``head_size``, ``sliding_window``, ``has_sink``, ``impl.scale``,
``impl.logits_soft_cap``), which ``attention_replaced`` stands in for by assigning
``self_attn.attn`` for the duration of a call (the stand-in is called as
``Attention.forward(query, key, value)``, each ``[T, heads * head_size]``). Written against
vLLM 0.32 (CPU); 0.33's source has the same attributes and calls.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch

# Causal LMs with the Llama decoder structure (model.model.layers[i].self_attn.attn).
SUPPORTED_ARCHITECTURES = frozenset(
    {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"}
)


class UnsupportedModel(RuntimeError):
    """The loaded model is not one the runner can drive; recompute stays off."""


@dataclass(frozen=True, eq=False)  # holds modules: compare by identity
class DecoderLayer:
    module: torch.nn.Module  # the decoder layer
    holder: torch.nn.Module  # the module whose ``attn`` attribute is the vLLM Attention
    attn: torch.nn.Module
    layer_name: str  # its KV cache's name
    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float

    def __call__(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's own forward: ``(hidden, residual)`` after it."""
        return self.module(positions, hidden, residual)


@dataclass(frozen=True, eq=False)
class DecoderStack:
    layers: tuple[DecoderLayer, ...]
    embed: Callable[[torch.Tensor], torch.Tensor]  # token ids -> input hidden states
    norm: torch.nn.Module  # the final norm
    device: torch.device

    def final_norm(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """The model's final norm over the last layer's output (residual added)."""
        out, _ = self.norm(hidden, residual)
        return out


def decoder_stack(model: torch.nn.Module) -> DecoderStack:
    """``model``'s decoder layers; ``UnsupportedModel`` where it is not a whole Llama-structure
    stack (another architecture, a pipeline stage) or a layer uses what the recompute's
    attention does not (sliding window, soft cap, sinks)."""
    name = type(model).__name__
    if name not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModel(f"{name} is not a Llama-structure model the runner knows")
    from vllm.model_executor.layers.attention.attention import Attention

    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or not hasattr(inner, "embed_input_ids"):
        raise UnsupportedModel(f"{name}: no model.layers / embed_input_ids")
    if getattr(inner, "start_layer", 0) != 0 or getattr(inner, "end_layer", len(layers)) != len(
        layers
    ):
        raise UnsupportedModel("pipeline-parallel stages are not supported")
    out = []
    for i, layer in enumerate(layers):
        holder = getattr(layer, "self_attn", None)
        attn = getattr(holder, "attn", None)
        if not isinstance(attn, Attention):
            raise UnsupportedModel(f"{name}: layer {i} has no vLLM Attention at self_attn.attn")
        impl = attn.impl
        if (
            attn.sliding_window is not None
            or getattr(impl, "logits_soft_cap", 0)
            or getattr(attn, "has_sink", False)
        ):
            raise UnsupportedModel(f"{name}: layer {i} uses sliding window, soft cap or sinks")
        out.append(
            DecoderLayer(
                layer,
                holder,
                attn,
                attn.layer_name,
                attn.num_heads,
                attn.num_kv_heads,
                attn.head_size,
                float(impl.scale),
            )
        )
    return DecoderStack(
        tuple(out), inner.embed_input_ids, inner.norm, next(model.parameters()).device
    )


@contextlib.contextmanager
def attention_replaced(layer: DecoderLayer, stand_in: torch.nn.Module):
    """Within the block, ``layer``'s attention is ``stand_in`` (called as vLLM's Attention)."""
    original = layer.holder.attn
    layer.holder.attn = stand_in
    try:
        yield
    finally:
        layer.holder.attn = original
