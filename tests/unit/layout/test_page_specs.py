"""Both KV page specs: a token written through a spec is read back, and lands where the
backend's own reader expects it (packed: K|V in the last dim; CPU: where vLLM's CPU cache-write
op puts it)."""

import pytest
import torch

from semshare_vllm.layout.paged_cache import slots_for, stack_layers
from semshare_vllm.layout.specs import (
    CpuAttnSpec,
    PackedKVSpec,
    UnsupportedKVLayout,
    WholePagesSpec,
    calibrate_cpu_pages,
    page_spec,
)

B, H, N, D = 6, 2, 32, 32


def tokens(t, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t, H, D, generator=g), torch.randn(t, H, D, generator=g)


def test_packed_spec_matches_flash_attn_reading():
    kv = torch.zeros(B, H, N, 2 * D)
    spec = page_spec("FLASH_ATTN", D)
    assert isinstance(spec, PackedKVSpec)
    slots = torch.tensor([0, 5, 33, 100, 191])
    k, v = tokens(len(slots), 0)
    spec.write(kv, slots, k, v)
    # FLASH_ATTN reads kv.transpose(1, 2).split(D, -1): K/V of token n of block b at [b, n, h]
    key_cache, value_cache = kv.transpose(1, 2).split(D, dim=-1)
    for i, s in enumerate(slots.tolist()):
        torch.testing.assert_close(key_cache[s // N, s % N], k[i])
        torch.testing.assert_close(value_cache[s // N, s % N], v[i])
    rk, rv = spec.read(kv, slots)
    torch.testing.assert_close(rk, k)
    torch.testing.assert_close(rv, v)


def test_packed_spec_on_token_major_physical_layout():
    # LBNHC: each token's [H, 2D] contiguous; the logical [B, H, N, C] is a permuted view.
    physical = torch.zeros(B, N, H, 2 * D)
    kv = physical.permute(0, 2, 1, 3)
    spec = PackedKVSpec("FLASH_ATTN", D)
    slots = torch.tensor([3, 64, 65])
    k, v = tokens(3, 1)
    spec.write(kv, slots, k, v)
    torch.testing.assert_close(physical[2, 0, :, :D], k[1])
    torch.testing.assert_close(physical[2, 1, :, D:], v[2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_spec_agrees_with_vllm_cache_write(dtype):
    """Write with vLLM's own CPU op, read with our spec (and the reverse)."""
    from vllm import _custom_ops as ops

    kv = torch.zeros(B, H, N, 2 * D, dtype=dtype)
    spec = page_spec("CPU_ATTN", D, cpu_isa="vec")
    assert isinstance(spec, CpuAttnSpec)
    slots = torch.tensor([1, 2, 40, 63, 64, 150])
    k, v = (x.to(dtype) for x in tokens(len(slots), 2))
    key_cache, value_cache = kv.view(B, H, 2 * N, D).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, "vec")
    rk, rv = spec.read(kv, slots)
    torch.testing.assert_close(rk, k)
    torch.testing.assert_close(rv, v)
    # ...and our write is byte-identical to the op's write.
    ours = torch.zeros_like(kv)
    spec.write(ours, slots, k, v)
    assert torch.equal(ours, kv)


def test_cpu_vec_kernel_stores_k_transposed():
    """The fact the calibration exists for: on the vec ISA, K pages are [D, N], V pages [N, D]."""
    k_pos, v_pos = calibrate_cpu_pages(N, D, torch.float32, "vec")
    n, d = torch.meshgrid(torch.arange(N), torch.arange(D), indexing="ij")
    assert torch.equal(k_pos, d * N + n)
    assert torch.equal(v_pos, n * D + d)


def test_unsupported_layouts_are_refused():
    with pytest.raises(UnsupportedKVLayout):
        page_spec("FLASH_ATTN", 64).check(torch.zeros(B, 1, N, 576))  # MLA-like latent cache
    with pytest.raises(UnsupportedKVLayout):
        page_spec("SOME_NEW_BACKEND", D).check(torch.zeros(B, H, N, 2 * D))
    with pytest.raises(UnsupportedKVLayout):
        page_spec("CPU_ATTN", D).check(torch.zeros(B, H, N, 2 * D))  # no ISA known


def test_a_backend_without_a_view_still_copies_whole_pages():
    """Quantised KV of any backend moves as raw pages; only token access is refused."""
    spec = page_spec("SOME_NEW_BACKEND", D)
    assert isinstance(spec, WholePagesSpec)
    src = torch.randn(1, 4, H, N, 2 * D)
    dst = torch.zeros(1, B, H, N, 2 * D)
    spec.copy_blocks(src, [0, 2], dst, [5, 1])
    assert torch.equal(dst[0, 5], src[0, 0]) and torch.equal(dst[0, 1], src[0, 2])
    with pytest.raises(UnsupportedKVLayout):
        spec.read(dst[0], torch.tensor([0]))
    with pytest.raises(UnsupportedKVLayout):
        spec.offsets(dst[0])


def test_specs_compare_and_name_by_layout():
    """The worker checks every layer has one layout (a set of specs) and records the name."""
    assert page_spec("FLASH_ATTN", D) == page_spec("FLASH_ATTN", D)
    assert len({page_spec("CPU_ATTN", D, "vec"), page_spec("CPU_ATTN", D, "vec")}) == 1
    assert page_spec("FLASH_ATTN", D) != page_spec("TRITON_ATTN", D)
    assert page_spec("CPU_ATTN", D, "vec").name == f"CPU_ATTN/vec/{D}"
    assert page_spec("FLASH_ATTN", D).name == f"FLASH_ATTN/-/{D}"


@pytest.mark.parametrize("backend", ["FLASH_ATTN", "CPU_ATTN"])
@pytest.mark.parametrize("start, count", [(0, 96), (5, 100), (32, 32), (40, 10), (7, 150)])
def test_range_io_equals_slot_io(backend, start, count):
    """Whole blocks go the fast page-copy way, partial blocks slot by slot: the same bytes."""
    block_ids = [5, 2, 4, 0, 3, 1]  # a request's blocks, in position order
    k, v = tokens(count, 3)
    fast = torch.zeros(B, H, N, 2 * D)
    slow = torch.zeros(B, H, N, 2 * D)
    spec = page_spec(backend, D, cpu_isa="vec")
    spec.write_range(fast, block_ids, start, k, v)
    spec.write(slow, slots_for(block_ids, start, start + count, N), k, v)
    assert torch.equal(fast, slow)
    rk, rv = spec.read_range(fast, block_ids, start, count)
    assert torch.equal(rk, k) and torch.equal(rv, v)


@pytest.mark.parametrize("kind", ["FLASH_ATTN", "CPU_ATTN", "permuted", "one_head"])
def test_block_reads_are_copies(kind):
    """``read_blocks`` hands out its own tensors (a semantic load rotates K in place), also
    where a reshape could have been a view (one KV head; pages already token-major)."""
    heads = 1 if kind == "one_head" else H
    if kind == "permuted":
        g = torch.Generator().manual_seed(9)
        orders = tuple(torch.randperm(N * D, generator=g).view(N, D) for _ in range(2))
        spec = CpuAttnSpec("CPU_ATTN", D, positions=orders)
    else:
        spec = page_spec("CPU_ATTN" if kind == "one_head" else kind, D, cpu_isa="vec")
    cache = torch.randn(B, heads, N, 2 * D)
    before = cache.clone()
    k, v = spec.read_blocks(cache, torch.tensor([3, 1]))
    k.add_(1.0)
    v.add_(1.0)
    assert torch.equal(cache, before)


def test_any_page_permutation_block_and_slot_paths_agree():
    """A kernel with some other in-page order (say, another ISA's tiling) is still served."""
    g = torch.Generator().manual_seed(4)
    k_pos = torch.randperm(N * D, generator=g).view(N, D)
    v_pos = torch.randperm(N * D, generator=g).view(N, D)
    spec = CpuAttnSpec("CPU_ATTN", D, positions=(k_pos, v_pos))
    fast, slow = torch.zeros(B, H, N, 2 * D), torch.zeros(B, H, N, 2 * D)
    k, v = tokens(3 * N, 5)
    spec.write_range(fast, [4, 1, 2], 0, k, v)
    spec.write(slow, torch.cat([torch.arange(N) + b * N for b in (4, 1, 2)]), k, v)
    assert torch.equal(fast, slow)
    # the page really is permuted: element (n=0, d=1) of block 4, head 0 sits at k_pos[0, 1]
    assert fast.view(B, H, 2, N * D)[4, 0, 0, k_pos[0, 1]] == k[0, 0, 1]
    rk, rv = spec.read_range(fast, [4, 1, 2], 0, 3 * N)
    assert torch.equal(rk, k) and torch.equal(rv, v)


@pytest.mark.parametrize("backend", ["FLASH_ATTN", "CPU_ATTN"])
@pytest.mark.parametrize(
    "src_start, dst_start, count", [(0, 0, 96), (32, 64, 40), (3, 3, 70), (5, 37, 50), (0, 0, 10)]
)
def test_copy_tokens_between_page_tensors(backend, src_start, dst_start, count):
    """Donor pages -> cache blocks: raw page copies where aligned, token copies elsewhere; the
    target then holds exactly the donor's K/V at the new positions."""
    spec = page_spec(backend, D, "vec")
    donor = torch.zeros(4, H, N, 2 * D)
    k, v = tokens(4 * N, 6)
    spec.write_range(donor, [0, 1, 2, 3], 0, k, v)
    cache = torch.zeros(B, H, N, 2 * D)
    dst_blocks = [4, 0, 5, 2]
    spec.copy_tokens(
        donor[None], [0, 1, 2, 3], src_start, cache[None], dst_blocks, dst_start, count
    )
    rk, rv = spec.read_range(cache, dst_blocks, dst_start, count)
    assert torch.equal(rk, k[src_start : src_start + count])
    assert torch.equal(rv, v[src_start : src_start + count])


def test_stack_layers_views_one_buffer_and_falls_back():
    flat = torch.arange(3 * B * H * N * 2 * D, dtype=torch.float32)
    layers = [
        flat[i * B * H * N * 2 * D : (i + 1) * B * H * N * 2 * D].view(B, H, N, 2 * D)
        for i in range(3)
    ]
    [(span, stacked)] = stack_layers(layers)
    assert span == slice(0, 3) and stacked.shape == (3, B, H, N, 2 * D)
    for i in range(3):
        assert torch.equal(stacked[i], layers[i])
    stacked[2, 1] = -1  # a view: writes land in the layer tensors
    assert (layers[2][1] == -1).all()
    separate = [torch.zeros(B, H, N, 2 * D) for _ in range(2)]
    stacks = stack_layers(separate)
    assert [s for s, _ in stacks] == [slice(0, 1), slice(1, 2)]
    assert stacks[1][1].data_ptr() == separate[1].data_ptr()
    # Views of one buffer at a uniform step that share elements: one stack would write a
    # position through two layers at once, so each layer stands alone.
    size = B * H * N * 2 * D
    overlapping = [flat[i * 2 * D : i * 2 * D + size].view(B, H, N, 2 * D) for i in range(3)]
    assert [s for s, _ in stack_layers(overlapping)] == [slice(0, 1), slice(1, 2), slice(2, 3)]
