"""Which implementation a kernel entry point runs: Triton or the torch reference."""

from __future__ import annotations

from importlib.util import find_spec

import torch

IMPLS = ("auto", "triton", "torch")


def use_triton(tensor: torch.Tensor, impl: str = "auto") -> bool:
    """ "auto": Triton for CUDA tensors, torch otherwise (CPU-only installs may lack Triton, and
    on CPU the interpreter is a test tool, never a serving path, even when TRITON_INTERPRET is
    set). "triton" on CPU tensors needs TRITON_INTERPRET=1 (the tests force it that way)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl != "auto":
        return impl == "triton"
    return tensor.is_cuda and find_spec("triton") is not None
