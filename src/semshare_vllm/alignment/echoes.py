"""Echoes: aligned target tokens that repeat a rare pair of tokens from text the two prompts do
not share.

A donor's KV for an aligned token was computed in the donor's context. Where the prompts differ
by a question or a name, an aligned passage that mentions what either question names (a title,
an entity) is read differently by the deeper layers: on real doc-qa pairs (SmolLM2-135M) the
K/V of such passages deviated 0.1-0.2 from cold in layers 16-20 while their layer-1 deviation
ranked them past the first 15% of tokens, and the held-out reference's perplexity was
1.07-1.12x cold's until they were recomputed (docs/benchmarks.md, echoes). A token pair that
came earlier in the unshared text is a cheap trace of that link (a token's KV reads only what
precedes it): the tokens an echo starts are recomputed with those after it
(``recompute_echo_span``), in every layer, by the recompute policy. Only the chosen donor's
alignment gets its echoes (``with_echoes``), and only when that knob is on.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from semshare_vllm.alignment.result import Alignment, MatchKind

# A pair seen more often than this among the shared tokens is common text ("of the"), not the
# mention of one thing.
MAX_REPEATS = 3


def echo_starts(
    target: np.ndarray, donor: np.ndarray, donor_pos: np.ndarray, kind: np.ndarray
) -> np.ndarray:
    """Target positions starting a shared pair (two exactly aligned tokens taking consecutive
    donor tokens) whose ids also form an unshared pair before it, in the target (before the
    position: the target's KV there reads it) or in the donor (before the donor position: the
    donor's KV there read it), and at most ``MAX_REPEATS`` times among the target's shared
    pairs. Unshared: a target pair not shared, a donor pair no shared target pair takes."""
    t = np.asarray(target, dtype=np.int64)
    d = np.asarray(donor, dtype=np.int64)
    donor_pos = np.asarray(donor_pos, dtype=np.int64)
    kind = np.asarray(kind)
    none = np.zeros(0, dtype=np.int64)
    if len(t) < 2 or len(d) < 2:
        return none
    exact = (donor_pos >= 0) & (kind == MatchKind.EXACT)
    shared = exact[:-1] & exact[1:] & (donor_pos[1:] == donor_pos[:-1] + 1)
    t_pairs, d_pairs = _pairs(t), _pairs(d)
    d_shared = np.zeros(len(d_pairs), dtype=bool)
    d_shared[donor_pos[:-1][shared]] = True
    candidates = np.flatnonzero(shared)
    values, counts = np.unique(t_pairs[candidates], return_counts=True)
    rare = values[counts <= MAX_REPEATS]
    candidates = candidates[np.isin(t_pairs[candidates], rare)]
    v = t_pairs[candidates]
    in_target = _first_before(t_pairs, ~shared, v, candidates)
    in_donor = _first_before(d_pairs, ~d_shared, v, donor_pos[candidates])
    return candidates[in_target | in_donor] if len(candidates) else none


def with_echoes(al: Alignment, target, donor) -> Alignment:
    """``al`` with its ``echoes`` set (``echo_starts`` of the two prompts' tokens)."""
    return replace(al, echoes=echo_starts(target, donor, al.donor_pos, al.kind))


def _first_before(
    pairs: np.ndarray, unshared: np.ndarray, values: np.ndarray, before: np.ndarray
) -> np.ndarray:
    """Per value: whether ``pairs`` holds it, unshared, at an index below ``before``."""
    seen, first = np.unique(pairs[unshared], return_index=True)
    if not len(seen) or not len(values):
        return np.zeros(len(values), dtype=bool)
    at = np.flatnonzero(unshared)[first]  # index of each seen value's first unshared pair
    i = np.minimum(np.searchsorted(seen, values), len(seen) - 1)
    return (seen[i] == values) & (at[i] < before)


def _pairs(tokens: np.ndarray) -> np.ndarray:
    """One int64 per pair of neighbouring token ids (ids fit 32 bits)."""
    return (tokens[:-1] << 32) | (tokens[1:] & 0xFFFFFFFF)
