"""A vLLM rotary-embedding module, read as one position -> angle table (RoPE correction).

Touches, on a module ``get_rope`` returns (as a model holds it at
``model.layers[i].self_attn.rotary_emb``): its class name (``SUPPORTED_ROPE_CLASSES``),
``scaling_factors`` (linear scaling with several LoRA factors stacks one table per factor),
``_compute_cos_sin_cache()`` (else the ``cos_sin_cache`` buffer, cast to the model dtype),
``head_size``, ``rotary_dim`` and ``is_neox_style``; and the table's layout: ``[max_pos,
rotary_dim]`` rows of ``cos | sin``, times a YaRN ``mscale`` for some classes. Written against
vLLM 0.32 (CPU); 0.33's source has the same attributes and layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# vLLM rotary classes verified to be "one position -> one angle table, rotary dims first"
# (tests/unit/kernels/test_kernels_rope.py checks each against the module's own forward).
# Anything else (mrope variants with 3-D positions, Phi3 LongRoPE's two tables, dual-chunk, Gemma4's
# proportional rope, Fourier rope, DeepSeek-V4 with rotary dims last, ...) is refused.
SUPPORTED_ROPE_CLASSES = frozenset(
    {
        "RotaryEmbedding",
        "LinearScalingRotaryEmbedding",
        "NTKScalingRotaryEmbedding",
        "DynamicNTKScalingRotaryEmbedding",
        "DynamicNTKAlphaRotaryEmbedding",
        "Llama3RotaryEmbedding",
        "YaRNScalingRotaryEmbedding",
        "DeepseekScalingRotaryEmbedding",
    }
)


class UnsupportedRope(RuntimeError):
    """This rotary embedding is not a single position->angle table; the caller recomputes."""


@dataclass(frozen=True, eq=False)  # holds a tensor: compare by identity
class RotaryAngles:
    cos_sin: torch.Tensor  # [max_pos, rotary_dim] fp32 on CPU: cos | sin, unit magnitude
    head_size: int
    rotary_dim: int
    is_neox: bool


def rotary_angles(rotary_emb) -> RotaryAngles:
    """The angle table of a vLLM rotary module, in fp32, normalised to a pure rotation."""
    name = type(rotary_emb).__name__
    if name not in SUPPORTED_ROPE_CLASSES:
        raise UnsupportedRope(f"rotary embedding {name} is not a single angle table")
    if len(getattr(rotary_emb, "scaling_factors", (1.0,))) != 1:
        raise UnsupportedRope(f"{name} with several scaling factors")
    compute = getattr(rotary_emb, "_compute_cos_sin_cache", None)
    # Recompute in fp32: the registered buffer is cast to the model dtype (often bf16).
    table = compute() if compute is not None else rotary_emb.cos_sin_cache
    table = table.detach().to(device="cpu", dtype=torch.float32)
    half = rotary_emb.rotary_dim // 2
    # YaRN-style tables hold mscale * (cos | sin); cos(0) = 1, so row 0 reads mscale per dim.
    scale = table[0, :half]
    if not bool((scale > 0).all()):
        raise UnsupportedRope(f"{name}: angle table row 0 is not a rotation")
    if not bool((scale == 1).all()):
        table = table / torch.cat((scale, scale))
    return RotaryAngles(
        table.contiguous(),
        int(rotary_emb.head_size),
        int(rotary_emb.rotary_dim),
        bool(rotary_emb.is_neox_style),
    )


def model_rotary_embedding(model: torch.nn.Module):
    """The rotary module of a loaded vLLM model with the Llama structure (its first decoder
    layer's ``self_attn.rotary_emb``; every layer shares its angles)."""
    try:
        return model.model.layers[0].self_attn.rotary_emb
    except (AttributeError, IndexError, TypeError) as exc:
        raise UnsupportedRope(
            f"{type(model).__name__}: no model.layers[0].self_attn.rotary_emb"
        ) from exc
