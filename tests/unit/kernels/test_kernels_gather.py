"""The torch reference of the fused gather + RoPE + scatter against the obvious slow version: one
token at a time through ``layout.specs``' token writes, for packed and CPU_ATTN pages."""

import pytest
import torch
from support.page_tensors import (
    KINDS,
    MAX_POS,
    B,
    D,
    H,
    L,
    N,
    layer_tensors,
    make_table,
    orders,
    spec_of,
)

from semshare_vllm.kernels.gather_rearrange import (
    gather_rearrange,
    gather_rearrange_reference,
    stage_rows,
)
from semshare_vllm.kernels.rope import rope_correct_reference
from semshare_vllm.layout.specs import CpuAttnSpec, UnsupportedKVLayout, page_spec

T_SRC, M = 40, 37


def target(kind, dtype, arrangement):
    """(caches, their offsets, the spec) of one layout."""
    caches = layer_tensors(arrangement, dtype, token_major=kind == "packed_token_major")
    spec = spec_of(kind)
    return caches, spec.offsets(caches[0]), spec


def moves(seed, table):
    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(0, T_SRC, (M,), generator=g)
    rows[1] = rows[0]  # a source row used twice
    slots = torch.randperm(B * N, generator=g)[:M]
    src_pos = torch.randint(0, MAX_POS, (M,), generator=g)
    dst_pos = torch.randint(0, MAX_POS, (M,), generator=g)
    dst_pos[::5] = src_pos[::5]
    return rows, slots, src_pos, dst_pos


def staging(dtype, seed):
    """``[L, T, H, 2D]`` with non-contiguous strides (a transposed view)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T_SRC, L, H, 2 * D, generator=g).to(dtype).transpose(0, 1)


def slow_move(src, rows, slots, caches, spec, table, src_pos, dst_pos):
    for layer, cache in enumerate(caches):
        for m in range(len(rows)):
            kv = src[layer, rows[m]][None]  # [1, H, 2D]
            k = kv[..., :D].float()
            if table is not None:
                k = rope_correct_reference(k, src_pos[m : m + 1], dst_pos[m : m + 1], table)
            spec.write(cache, slots[m : m + 1], k, kv[..., D:])


DTYPES = [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.bfloat16),
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("src_dtype, cache_dtype", DTYPES)
@pytest.mark.parametrize("rope", [None, "neox", "gptj_partial"])
@pytest.mark.parametrize("arrangement", ["uniform", "separate", "irregular"])
def test_reference_equals_slow_token_by_token(kind, src_dtype, cache_dtype, rope, arrangement):
    table = make_table(rope)
    src = staging(src_dtype, seed=1)
    rows, slots, src_pos, dst_pos = moves(2, table)
    fast, offsets, _ = target(kind, cache_dtype, arrangement)
    slow, _, spec = target(kind, cache_dtype, arrangement)
    gather_rearrange_reference(src, rows, slots, fast, offsets, table, src_pos, dst_pos)
    slow_move(src, rows, slots, slow, spec, table, src_pos, dst_pos)
    for f, s in zip(fast, slow):
        assert torch.equal(f, s)
    assert any(bool(f.abs().sum() > 0) for f in fast)
    if table is not None:  # the rotation did happen
        plain, _, _ = target(kind, cache_dtype, arrangement)
        gather_rearrange_reference(src, rows, slots, plain, offsets)
        assert not torch.equal(plain[0], fast[0])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("arrangement", ["uniform", "irregular"])
def test_stage_rows_reads_what_the_spec_reads(kind, arrangement):
    caches, offsets, spec = target(kind, torch.bfloat16, arrangement)
    g = torch.Generator().manual_seed(5)
    for c in caches:
        c.copy_(torch.randn(c.shape, generator=g).to(c.dtype))
    slots = torch.randperm(B * N, generator=g)[:M]
    staged = stage_rows(caches, slots, offsets)
    assert staged.shape == (L, M, H, 2 * D) and staged.dtype == torch.bfloat16
    for layer, cache in enumerate(caches):
        k, v = spec.read(cache, slots)
        assert torch.equal(staged[layer], torch.cat((k, v), dim=-1))
    # a pool of another size with the same pages (the host store's) is read alike
    pool = torch.empty_strided((B + 2, H, N, 2 * D), caches[0].stride(), dtype=torch.bfloat16)
    pool[:B] = caches[0]
    assert torch.equal(stage_rows([pool], slots, offsets)[0], staged[0])
    with pytest.raises(ValueError):
        stage_rows([caches[0][:, :1]], slots, offsets)


def test_cpu_vec_offsets_are_k_transposed():
    cache = torch.zeros(B, H, N, 2 * D)
    a = page_spec("CPU_ATTN", D, "vec").offsets(cache)
    n, d = torch.meshgrid(torch.arange(N), torch.arange(D), indexing="ij")
    assert torch.equal(a.k_offsets.long(), d * N + n)
    assert torch.equal(a.v_offsets.long(), N * D + n * D + d)
    assert (a.block_stride, a.head_stride) == (H * N * 2 * D, N * 2 * D)


def test_dispatcher_torch_path_and_edge_cases():
    table = make_table("neox")
    src = staging(torch.float32, seed=3)
    rows, slots, src_pos, dst_pos = moves(4, table)
    want, offsets, _ = target("cpu_vec", torch.float32, "uniform")
    got, _, _ = target("cpu_vec", torch.float32, "uniform")
    gather_rearrange_reference(src, rows, slots, want, offsets, table, src_pos, dst_pos)
    gather_rearrange(src, rows, slots, got, offsets, table, src_pos, dst_pos, impl="torch")
    assert all(torch.equal(w, g) for w, g in zip(want, got))
    empty = torch.zeros(0, dtype=torch.long)
    gather_rearrange(src, empty, empty, got, offsets, table, empty, empty, impl="torch")
    assert all(torch.equal(w, g) for w, g in zip(want, got))
    with pytest.raises(ValueError):  # a cache of another shape than the offsets'
        gather_rearrange_reference(src, rows, slots, [torch.zeros(B + 1, H, N, 2 * D)] * L, offsets)
    with pytest.raises(ValueError):  # RoPE without positions
        gather_rearrange_reference(src, rows, slots, got, offsets, table)
    with pytest.raises(UnsupportedKVLayout):  # CPU pages must be contiguous
        CpuAttnSpec("CPU_ATTN", D, positions=orders("x")).offsets(
            torch.zeros(B, N, H, 2 * D).permute(0, 2, 1, 3)
        )
