"""Exact RoPE correction of cached keys: a key rotated for donor position p, re-rotated for q.

A cached key is ``R(p) k`` (times a YaRN magnitude ``mscale`` for some models); the target
request needs ``R(q) k``. Rotations compose, so the correction is the pure rotation
``R(q) R(p)^-1`` with, per rotary pair i, ``cos = cq*cp + sq*sp`` and ``sin = sq*cp - cq*sp``
(angle-difference identities over the model's own angle table). The magnitude factor is already
in the cached key, so the table used here is normalised to a pure rotation.

V is never rotated: RoPE applies to queries and keys only, so V moves as is.

The angle table comes from vLLM's rotary module itself (``RopeTable.from_vllm`` /
``from_model``, read through ``vllm_compat.rotary``), so linear, dynamic-NTK, llama3, YaRN and
DeepSeek-YaRN scaling are whatever vLLM computes. Every float op below is done in fp32, in the
order the Triton kernels (``triton_rope``) use too, so both give bit-identical fp32 results where
the hardware does not fuse multiply-adds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from semshare_vllm.vllm_compat.rotary import UnsupportedRope as UnsupportedRope  # re-exported
from semshare_vllm.vllm_compat.rotary import model_rotary_embedding, rotary_angles

from .dispatch import use_triton


@dataclass(frozen=True, eq=False)  # holds tensors: compare by identity
class RopeTable:
    """One model's rotary angles, as unit-magnitude ``[cos | sin]`` rows (vLLM's cache layout).

    ``cos_sin[pos, i]`` = cos(pos * theta_i) and ``cos_sin[pos, rotary_dim/2 + i]`` = its sine,
    fp32. Dims ``>= rotary_dim`` of a head are not rotated (partial rotary). Neox style pairs
    dims (i, i + rotary_dim/2); GPT-J style pairs (2i, 2i + 1).
    """

    cos_sin: torch.Tensor
    head_size: int
    rotary_dim: int
    is_neox: bool

    def __post_init__(self):
        if self.cos_sin.dim() != 2 or self.cos_sin.shape[1] != self.rotary_dim:
            raise ValueError(
                f"cos_sin must be [max_pos, {self.rotary_dim}], got {tuple(self.cos_sin.shape)}"
            )
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_size:
            raise ValueError(f"bad rotary_dim {self.rotary_dim} for head_size {self.head_size}")
        if self.cos_sin.dtype != torch.float32 or not self.cos_sin.is_contiguous():
            raise ValueError("cos_sin must be a contiguous fp32 tensor")

    @property
    def half(self) -> int:
        return self.rotary_dim // 2

    @property
    def max_position(self) -> int:
        return self.cos_sin.shape[0]

    def to(self, device: torch.device | str) -> RopeTable:
        if self.cos_sin.device == torch.device(device):
            return self
        return RopeTable(self.cos_sin.to(device), self.head_size, self.rotary_dim, self.is_neox)

    @classmethod
    def from_vllm(cls, rotary_emb, device: torch.device | str | None = None) -> RopeTable:
        """The table of a vLLM rotary module (what ``get_rope`` returns); ``UnsupportedRope``
        for one that is not a single angle table (``vllm_compat.rotary``)."""
        angles = rotary_angles(rotary_emb)
        return cls(
            angles.cos_sin.to(device or "cpu"), angles.head_size, angles.rotary_dim, angles.is_neox
        )

    @classmethod
    def from_model(cls, model, device: torch.device | str | None = None) -> RopeTable:
        """The table of a loaded vLLM model's own rotary module (Llama structure)."""
        return cls.from_vllm(model_rotary_embedding(model), device)


@dataclass(frozen=True, eq=False)  # holds tensors: compare by identity
class RopeDelta:
    """Per-token correction rotation, ``[T, rotary_dim/2]`` fp32 each; ``same`` marks p == q."""

    cos: torch.Tensor
    sin: torch.Tensor
    same: torch.Tensor


def rope_delta(table: RopeTable, src_pos: torch.Tensor, dst_pos: torch.Tensor) -> RopeDelta:
    """cos/sin of ``q*theta - p*theta`` from the table rows of p and q (no trig recomputed)."""
    cos_sin = table.cos_sin
    src = src_pos.to(device=cos_sin.device, dtype=torch.long)
    dst = dst_pos.to(device=cos_sin.device, dtype=torch.long)
    cp, sp = cos_sin.index_select(0, src).split(table.half, dim=1)
    cq, sq = cos_sin.index_select(0, dst).split(table.half, dim=1)
    # Operation order shared with triton_rope.rope_delta: keep both bit-identical.
    cos = cq * cp + sq * sp
    sin = sq * cp - cq * sp
    return RopeDelta(cos, sin, src == dst)


def apply_rope_delta(
    k: torch.Tensor, delta: RopeDelta, table: RopeTable, out: torch.Tensor
) -> torch.Tensor:
    """Rotate ``k`` ``[T, H, D]`` by ``delta`` into ``out`` (any dtype; may be ``k`` itself).

    Rotated dims are computed in fp32 and cast once; pass-through dims and p == q tokens are
    copied, so they come out exactly as ``k`` (cast to ``out``'s dtype).

    Each pair (x1, x2) becomes (x1*cos - x2*sin, x2*cos + x1*sin), computed on all pairs as one
    tensor: ``x * cos`` plus the pairs swapped times ``(-sin, sin)``. Adding a negated product
    rounds exactly as subtracting it, so the result is bit-identical to the element-wise
    formula (and to the Triton kernel), in a few contiguous passes instead of strided ones.
    """
    rd, half, t = table.rotary_dim, table.half, k.shape[0]
    # neox pairs (i, i + half): [.., 2, half]; GPT-J pairs (2i, 2i + 1): [.., half, 2]
    pair_dim, pairs = (-2, (2, half)) if table.is_neox else (-1, (half, 2))
    per_token = (t, 1, 1, half) if table.is_neox else (t, 1, half, 1)
    x = k[..., :rd].float().unflatten(-1, pairs)
    sign = torch.tensor([-1.0, 1.0], device=x.device).view((2, 1) if table.is_neox else (2,))
    rotated = x * delta.cos.view(per_token)
    rotated.add_(x.flip(pair_dim).mul_(delta.sin.view(per_token) * sign))
    same = delta.same.to(k.device)
    if bool(same.any()):
        rotated[same] = x[same]
    # Computed whole before anything is written, so out may alias k.
    out[..., :rd] = rotated.flatten(-2)
    if rd < k.shape[-1] and out.data_ptr() != k.data_ptr():
        out[..., rd:] = k[..., rd:]
    return out


def _check(k: torch.Tensor, src_pos: torch.Tensor, dst_pos: torch.Tensor, table: RopeTable):
    if k.dim() != 3 or k.shape[-1] != table.head_size:
        raise ValueError(f"k must be [T, H, {table.head_size}], got {tuple(k.shape)}")
    if src_pos.shape != (k.shape[0],) or dst_pos.shape != (k.shape[0],):
        raise ValueError("src_pos and dst_pos must be [T]")


def rope_correct_reference(
    k: torch.Tensor, src_pos: torch.Tensor, dst_pos: torch.Tensor, table: RopeTable
) -> torch.Tensor:
    """``k`` ``[T, H, D]`` rotated for ``src_pos`` -> rotated for ``dst_pos`` (new tensor, same
    dtype). The torch reference of the Triton kernel."""
    _check(k, src_pos, dst_pos, table)
    table = table.to(k.device)
    return apply_rope_delta(k, rope_delta(table, src_pos, dst_pos), table, torch.empty_like(k))


def correct_rope(
    k: torch.Tensor,
    src_pos: torch.Tensor,
    dst_pos: torch.Tensor,
    table: RopeTable,
    out: torch.Tensor | None = None,
    impl: str = "auto",
) -> torch.Tensor:
    """RoPE-correct ``k`` ``[T, H, D]`` from ``src_pos`` to ``dst_pos`` into ``out`` (default a
    new tensor like ``k``; may be ``k`` for in place). Triton on CUDA, torch otherwise;
    ``impl`` = "triton" / "torch" forces one."""
    _check(k, src_pos, dst_pos, table)
    if out is None:
        out = torch.empty_like(k)
    if out.shape != k.shape:
        raise ValueError("out must have k's shape")
    if k.shape[0] == 0:
        return out
    table = table.to(k.device)
    if use_triton(k, impl):
        from .triton_rope import rope_correct_triton

        rope_correct_triton(k, src_pos.to(k.device), dst_pos.to(k.device), table, out)
        return out
    return apply_rope_delta(k, rope_delta(table, src_pos, dst_pos), table, out)
