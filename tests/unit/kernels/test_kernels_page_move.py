"""The CPU path of a semantic load (``kernels.page_move``: whole pages through the layout) against
the fused kernel's torch reference (``stage_rows`` + ``gather_rearrange_reference``), bit for
bit, on every page layout the kernels address: the same cache after either, everywhere."""

import numpy as np
import pytest
import torch
from support.page_tensors import KINDS, N, layer_tensors, make_table, spec_of

from semshare_vllm.kernels.gather_rearrange import gather_rearrange_reference, stage_rows
from semshare_vllm.kernels.page_move import move_aligned_rows
from semshare_vllm.layout.paged_cache import slots_for

DONOR_BLOCKS = [9, 2, 11, 4]  # 64 donor positions, blocks in no order
TARGET_BLOCKS = [0, 7, 3, 10, 5]  # 80 target positions
DST_START = 21  # mid-block: positions [16, 21) of block 7 are the request's own


def alignment(seed: int, kind: str = "mixed") -> np.ndarray:
    """donor_pos for target positions DST_START.. . "mixed": a shifted run, holes, a run at its
    own positions (no rotation), a reordered run and a repeated row, like the aligner's output;
    "run": one shifted run, every position aligned (moved without a gather, and the target's
    whole blocks written without being read); "run_with_hole": the same with one hole."""
    if kind != "mixed":
        pos = np.arange(7, 7 + 64 - 7)  # from mid-block: the target span ends mid-block too
        if kind == "run_with_hole":
            pos[20] = -1
        return pos
    g = np.random.default_rng(seed)
    return np.concatenate(
        [
            np.arange(30, 48),  # shifted by +9
            [-1, -1, -1],
            np.arange(42, 52),  # at its own positions: 21 + 21 + i
            g.permutation(np.arange(0, 12)),
            [5, 5, -1],
            np.arange(60, 64),
        ]
    )


def fresh(kind, dtype, arrangement, seed):
    """Per-layer caches of ``kind`` filled with random bits (what sits in fresh blocks)."""
    caches = layer_tensors(arrangement, dtype, token_major=kind == "packed_token_major")
    g = torch.Generator().manual_seed(seed)
    for c in caches:
        c.copy_(torch.randn(c.shape, generator=g).to(dtype))
    return caches


def reference_move(
    spec, donor, target, donor_pos, table, donor_blocks=DONOR_BLOCKS, dst_start=DST_START
):
    aligned = np.flatnonzero(donor_pos >= 0)
    rows, src_rows = np.unique(donor_pos[aligned], return_inverse=True)
    donor_slots = slots_for(donor_blocks, 0, int(rows[-1]) + 1, N)[rows]
    target_pos = dst_start + aligned
    dst_slots = slots_for(TARGET_BLOCKS, 0, len(TARGET_BLOCKS) * N, N)[target_pos]
    staged = stage_rows(donor, donor_slots, spec.offsets(donor[0]))
    src = torch.as_tensor(src_rows)
    gather_rearrange_reference(
        staged,
        src,
        dst_slots,
        target,
        spec.offsets(target[0]),
        table,
        torch.as_tensor(rows)[src],
        torch.as_tensor(target_pos),
    )


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rope", [None, "neox", "gptj_partial"])
@pytest.mark.parametrize("arrangement", ["uniform", "irregular"])
@pytest.mark.parametrize(("shape", "dst_start"), [("mixed", DST_START), ("run", 16), ("run", 5)])
def test_page_move_equals_the_kernel_reference(kind, dtype, rope, arrangement, shape, dst_start):
    spec, table = spec_of(kind), make_table(rope)
    donor = fresh(kind, dtype, arrangement, seed=1)
    by_pages = fresh(kind, dtype, arrangement, seed=2)
    by_reference = fresh(kind, dtype, arrangement, seed=2)
    before = [c.clone() for c in by_pages]
    donor_pos = alignment(3, shape)
    move_aligned_rows(
        spec, donor, DONOR_BLOCKS, by_pages, TARGET_BLOCKS, dst_start, donor_pos, table
    )
    reference_move(spec, donor, by_reference, donor_pos, table, dst_start=dst_start)
    for moved, ref, old in zip(by_pages, by_reference, before):
        assert torch.equal(moved, ref)
        assert not torch.equal(moved, old)  # the move did write


@pytest.mark.parametrize("shape", ["run", "run_with_hole"])
def test_a_run_over_whole_target_blocks_leaves_every_other_position_as_it_was(shape):
    """Target positions [16, 73) take a donor run: blocks 1-3 of the target are whole (written
    without being read, unless the hole sits in one), block 4 holds other positions after the
    run, block 0 is the request's own prefix: only the moved positions change."""
    spec, table = spec_of("cpu_vec"), make_table("neox")
    donor = fresh("cpu_vec", torch.float32, "uniform", seed=7)
    cache = fresh("cpu_vec", torch.float32, "uniform", seed=8)
    ref = [c.clone() for c in cache]
    donor_pos = alignment(0, shape)
    move_aligned_rows(spec, donor, DONOR_BLOCKS, cache, TARGET_BLOCKS, 16, donor_pos, table)
    reference_move(spec, donor, ref, donor_pos, table, dst_start=16)
    for c, r in zip(cache, ref):
        assert torch.equal(c, r)


def test_the_donor_may_sit_in_the_same_cache_as_the_target():
    """A donor still in its own blocks is read from the cache the target is written to."""
    spec, table = spec_of("cpu_vec"), make_table("neox")
    cache = fresh("cpu_vec", torch.float32, "uniform", seed=4)
    ref = [c.clone() for c in cache]
    donor_pos = alignment(5)
    own = [1, 6, 8, 9]
    move_aligned_rows(spec, cache, own, cache, TARGET_BLOCKS, DST_START, donor_pos, table)
    reference_move(spec, ref, ref, donor_pos, table, donor_blocks=own)
    for c, r in zip(cache, ref):
        assert torch.equal(c, r)


def test_nothing_aligned_moves_nothing():
    spec = spec_of("cpu_vec")
    cache = fresh("cpu_vec", torch.float32, "uniform", seed=6)
    before = [c.clone() for c in cache]
    move_aligned_rows(
        spec, cache, DONOR_BLOCKS, cache, TARGET_BLOCKS, DST_START, np.full(10, -1), None
    )
    assert all(torch.equal(c, b) for c, b in zip(cache, before))
