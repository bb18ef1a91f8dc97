"""Edit alignment of the gaps between runs (rapidfuzz Levenshtein opcodes on token ids).

After the exact runs, an edited document leaves gaps: a target span between two runs whose
donor counterpart lies between the same two runs' donor ends. Aligning each gap pair by edit
distance recovers what a run's minimum length had to drop: short equal pieces (same token,
mapped one to one) and replaced words (mapped by position inside the replaced block). A
normalised-similarity pre-check (rapidfuzz, bit-parallel, exits early under the cutoff) skips
gap pairs that share too little to be edits of each other; those go to the later stages.
"""

from __future__ import annotations

import numpy as np
from rapidfuzz.distance import Levenshtein

from semshare_vllm.alignment.result import AlignmentBuilder, MatchKind, Run

# Largest gap pair (target tokens x donor tokens) edit-aligned as a whole: bounds the work.
MAX_CELLS = 16_000_000


def edit_map(
    t_seg: np.ndarray, d_seg: np.ndarray, min_similarity: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(target index, donor index, is_equal) inside two segments, or None when the segments'
    normalised Levenshtein similarity is below ``min_similarity``."""
    a, b = t_seg.tolist(), d_seg.tolist()
    # under the cutoff rapidfuzz returns 0 (and stops early)
    if (
        min_similarity > 0
        and Levenshtein.normalized_similarity(a, b, score_cutoff=min_similarity) == 0.0
    ):
        return None
    ts, ds, eq = [], [], []
    for op in Levenshtein.opcodes(a, b):
        n = min(op.src_end - op.src_start, op.dest_end - op.dest_start)
        if n == 0 or op.tag not in ("equal", "replace"):
            continue
        ts.append(np.arange(op.src_start, op.src_start + n))
        ds.append(np.arange(op.dest_start, op.dest_start + n))
        eq.append(np.full(n, op.tag == "equal"))
    if not ts:
        return None
    return np.concatenate(ts), np.concatenate(ds), np.concatenate(eq)


def take_edit_map(
    builder: AlignmentBuilder,
    stage: str,
    t0: int,
    d0: int,
    mapping: tuple[np.ndarray, np.ndarray, np.ndarray],
) -> int:
    """Apply an ``edit_map`` of segments starting at target ``t0`` / donor ``d0``; equal pieces
    also become runs (the recompute policy repairs the first tokens of every run)."""
    ti, di, eq = mapping
    free = builder.free[t0 + ti]
    ti, di, eq = ti[free], di[free], eq[free]
    kind = np.where(eq, MatchKind.EXACT, MatchKind.FUZZY).astype(np.int8)
    taken = builder.take(stage, t0 + ti, d0 + di, kind)
    if eq.any():
        # consecutive equal positions on one diagonal form one run
        te, de = ti[eq], di[eq]
        brk = np.flatnonzero((np.diff(te) != 1) | (np.diff(de) != 1)) + 1
        for a, b in zip(np.r_[0, brk], np.r_[brk, len(te)]):
            builder.runs.append(Run(t0 + int(te[a]), d0 + int(de[a]), int(b - a)))
    return taken


def gaps(free: np.ndarray) -> list[tuple[int, int]]:
    """``[start, stop)`` of each maximal run of free target positions."""
    edges = np.flatnonzero(np.diff(np.concatenate(([0], free.astype(np.int8), [0]))))
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2])]


def edit_stage(
    builder: AlignmentBuilder, target: np.ndarray, donor: np.ndarray, min_similarity: float
) -> int:
    """Edit-align every target gap with its donor counterpart (module docstring)."""
    n, m = len(target), len(donor)
    pos = builder.donor_pos
    taken = 0
    for a, b in gaps(builder.free):
        width = b - a
        left = pos[a - 1] + 1 if a > 0 else None  # donor right after the left neighbour
        right = pos[b] if b < n else None  # donor at the right neighbour
        if left is not None and right is not None:
            if not left <= right <= left + 2 * width + 32:
                continue  # the neighbours are not consecutive in the donor: no counterpart
            lo, hi = left, right
        elif left is not None:
            lo, hi = left, min(m, left + 2 * width)
        elif right is not None:
            lo, hi = max(0, right - 2 * width), right
        else:
            lo, hi = 0, m
        if hi <= lo or width * (hi - lo) > MAX_CELLS:
            continue
        mapping = edit_map(target[a:b], donor[lo:hi], min_similarity)
        if mapping is not None:
            taken += take_edit_map(builder, "edit", a, lo, mapping)
    return taken
