"""Token-identical runs between a target and a donor prompt, at any offset.

``find_runs`` lists every maximal run of at least ``min_len`` identical tokens: each ``min_len``
-gram of both prompts is hashed (polynomial hash, vectorised over positions), target grams are
looked up among the sorted donor grams, and matches on the same diagonal (donor position minus
target position) at consecutive target positions merge into runs. Every run is checked token by
token, so a hash collision can never pass as a match.

``align_exact`` turns runs into an ``Alignment``: longest runs first, each target position taken
once; where a span could come from several donor places (repeated text), the one whose offset is
closest to the already aligned neighbour's is chosen, so the alignment stays monotone where the
text allows. What is left of a run after longer runs took their positions is kept when it is
still ``min_len`` long.

No Python loop runs over tokens: the loops are over the ``min_len`` gram offsets and over runs.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from semshare_vllm.alignment.result import Alignment, MatchKind, Run

# Default shortest run worth taking (tokens); shorter coincidences ("of the", punctuation) are
# left to the fuzzy stage.
MIN_RUN = 16
# A gram that occurs more often than this in the donor (highly repetitive text) is matched at its
# first occurrences only: bounds the work on pathological prompts.
MAX_OCCURRENCES = 32
_PRIME = np.uint64(0x100000001B3)


def _gram_hashes(tokens: np.ndarray, k: int) -> np.ndarray:
    n = len(tokens) - k + 1
    h = np.zeros(n, dtype=np.uint64)
    t = tokens.astype(np.uint64)
    with np.errstate(over="ignore"):
        for r in range(k):
            h = h * _PRIME + t[r : r + n]
    return h


def find_runs(
    target: Sequence[int] | np.ndarray,
    donor: Sequence[int] | np.ndarray,
    min_len: int = MIN_RUN,
    max_occurrences: int = MAX_OCCURRENCES,
) -> list[Run]:
    """Every maximal run of >= ``min_len`` identical tokens, in (offset, target) order."""
    t = np.asarray(target, dtype=np.int64)
    d = np.asarray(donor, dtype=np.int64)
    k = min_len
    if k < 1 or len(t) < k or len(d) < k:
        return []
    th, dh = _gram_hashes(t, k), _gram_hashes(d, k)
    order = np.argsort(dh, kind="stable")
    sorted_dh = dh[order]
    lo = np.searchsorted(sorted_dh, th, "left")
    counts = np.minimum(np.searchsorted(sorted_dh, th, "right") - lo, max_occurrences)
    total = int(counts.sum())
    if total == 0:
        return []
    ti = np.repeat(np.arange(len(th), dtype=np.int64), counts)
    within = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
    diag = order[np.repeat(lo, counts) + within] - ti
    idx = np.lexsort((ti, diag))
    ti, diag = ti[idx], diag[idx]
    new = np.ones(len(ti), dtype=bool)
    new[1:] = (diag[1:] != diag[:-1]) | (ti[1:] != ti[:-1] + 1)
    first = np.flatnonzero(new)
    last = np.r_[first[1:], len(ti)] - 1
    runs = []
    for t0, t1, off in zip(ti[first].tolist(), ti[last].tolist(), diag[first].tolist()):
        length = t1 - t0 + k
        if np.array_equal(t[t0 : t0 + length], d[t0 + off : t0 + off + length]):
            runs.append(Run(t0, t0 + off, length))
    return runs


def align_exact(
    target: Sequence[int] | np.ndarray,
    donor: Sequence[int] | np.ndarray,
    min_len: int = MIN_RUN,
    max_occurrences: int = MAX_OCCURRENCES,
    sentence_starts: np.ndarray | None = None,
    snap: int = 0,
) -> Alignment:
    """Runs of at least ``min_len`` tokens, longest first (module docstring).

    With ``sentence_starts`` (bool per target position) and ``snap`` > 0, a run that begins or
    ends at most ``snap`` tokens away from a sentence boundary is cut there: a few tokens spilling
    into a neighbouring sentence are usually a coincidence of wording, and leaving them to the
    later stages keeps runs whole sentences."""
    n = len(target)
    donor_pos = np.full(n, -1, dtype=np.int64)
    offset_at = np.zeros(n, dtype=np.int64)  # offset of the run each position took
    taken = np.zeros(n, dtype=bool)
    used: list[Run] = []
    runs = find_runs(target, donor, min_len, max_occurrences)
    # Same target span, several donor places: one group, decided by the neighbours' offset.
    groups: dict[tuple[int, int], list[Run]] = {}
    for run in runs:
        groups.setdefault((run.length, run.target_start), []).append(run)
    for (length, start), options in sorted(groups.items(), key=lambda g: (-g[0][0], g[0][1])):
        run = (
            options[0] if len(options) == 1 else _closest(options, start, length, taken, offset_at)
        )
        for seg_start, seg_len in _free_segments(taken[start : start + length]):
            s = start + seg_start
            if sentence_starts is not None and snap > 0:
                cut_s, cut_e = _snap(sentence_starts, s, s + seg_len, snap)
                seg_start, seg_len, s = seg_start + cut_s - s, cut_e - cut_s, cut_s
            if seg_len < min_len:
                continue
            donor_pos[s : s + seg_len] = np.arange(
                run.donor_start + seg_start, run.donor_start + seg_start + seg_len
            )
            offset_at[s : s + seg_len] = run.offset
            taken[s : s + seg_len] = True
            used.append(Run(s, run.donor_start + seg_start, seg_len))
    kind = np.where(taken, MatchKind.EXACT, MatchKind.NONE).astype(np.int8)
    return Alignment(
        donor_pos,
        kind,
        tuple(sorted(used, key=lambda r: r.target_start)),
        {"exact": int(taken.sum())},
    )


def _snap(starts: np.ndarray, begin: int, end: int, snap: int) -> tuple[int, int]:
    """``[begin, end)`` with a short head / tail across a sentence boundary cut off."""
    if not starts[begin]:
        ahead = np.flatnonzero(starts[begin + 1 : min(end, begin + snap + 1)])
        if len(ahead):
            begin += 1 + int(ahead[0])
    if end < len(starts) and not starts[end]:
        behind = np.flatnonzero(starts[max(begin + 1, end - snap) : end])
        if len(behind):
            end = max(begin + 1, end - snap) + int(behind[-1])
    return begin, end


def _closest(
    options: list[Run], start: int, length: int, taken: np.ndarray, offset_at: np.ndarray
) -> Run:
    """The option whose offset is nearest the nearest aligned neighbour's (left, else right);
    with no neighbour yet, the earliest donor place."""
    left = np.flatnonzero(taken[:start])
    right = np.flatnonzero(taken[start + length :])
    if len(left):
        ref = offset_at[left[-1]]
    elif len(right):
        ref = offset_at[start + length + right[0]]
    else:
        return min(options, key=lambda r: r.donor_start)
    return min(options, key=lambda r: (abs(r.offset - ref), r.donor_start))


def _free_segments(taken: np.ndarray) -> list[tuple[int, int]]:
    """(start, length) of the maximal runs of False in ``taken``."""
    free = np.concatenate(([False], ~taken, [False])).astype(np.int8)
    edges = np.flatnonzero(np.diff(free))
    return [(int(a), int(b - a)) for a, b in zip(edges[::2], edges[1::2])]
