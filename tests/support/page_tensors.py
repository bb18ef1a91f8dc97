"""Per-layer paged KV tensors of every page layout the kernels address, small, and a hand-built
RoPE table: shared by the kernel tests."""

import torch

from semshare_vllm.kernels.rope import RopeTable
from semshare_vllm.layout.specs import CpuAttnSpec, page_spec

L, B, H, N, D = 3, 12, 2, 16, 32
MAX_POS = 300
KINDS = ["packed", "packed_token_major", "cpu_vec", "cpu_token_major", "cpu_permuted"]


def make_table(style):
    """A hand-built rotation table (vLLM-derived ones are covered by test_kernels_rope)."""
    if style is None:
        return None
    rotary_dim = D if style == "neox" else 24
    half = rotary_dim // 2
    inv_freq = 1.0 / 10000 ** (torch.arange(half, dtype=torch.float) / half)
    angles = torch.arange(MAX_POS, dtype=torch.float)[:, None] * inv_freq
    return RopeTable(
        torch.cat((angles.cos(), angles.sin()), dim=1), D, rotary_dim, is_neox=style == "neox"
    )


def layer_tensors(arrangement, dtype, token_major=False):
    """Per-layer ``[B, H, N, 2D]`` tensors: views of one buffer (what vLLM allocates), separate
    allocations, or one buffer at irregular offsets (no uniform stack)."""

    def one(storage):
        if token_major:  # physical [B, N, H, 2D], logical [B, H, N, 2D]
            return storage.view(B, N, H, 2 * D).permute(0, 2, 1, 3)
        return storage.view(B, H, N, 2 * D)

    size = B * H * N * 2 * D
    if arrangement == "uniform":
        flat = torch.zeros(L * size, dtype=dtype)
        return [one(flat[i * size : (i + 1) * size]) for i in range(L)]
    if arrangement == "separate":
        return [one(torch.zeros(size, dtype=dtype)) for _ in range(L)]
    flat = torch.zeros(L * size + 7 * L, dtype=dtype)
    starts = [0, size + 3, 2 * size + 7 * L - 1][:L]
    return [one(flat[s : s + size]) for s in starts]


def orders(kind):
    n, d = torch.meshgrid(torch.arange(N), torch.arange(D), indexing="ij")
    if kind == "cpu_token_major":
        return n * D + d, n * D + d
    g = torch.Generator().manual_seed(11)
    return (
        torch.randperm(N * D, generator=g).view(N, D),
        torch.randperm(N * D, generator=g).view(N, D),
    )


def spec_of(kind):
    if kind in ("packed", "packed_token_major"):
        return page_spec("FLASH_ATTN", D)
    if kind == "cpu_vec":  # the real order of vLLM's CPU kernel (K transposed)
        return page_spec("CPU_ATTN", D, "vec")
    return CpuAttnSpec("CPU_ATTN", D, positions=orders(kind))
