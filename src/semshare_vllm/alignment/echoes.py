"""Echoes: aligned target tokens that repeat a rare pair of tokens from text the two prompts do
not share.

A donor's KV for an aligned token was computed in the donor's context. Where the prompts differ
by a question or a name, the aligned passage that mentions the same thing (a title, the entity
asked about) is read differently by the deeper layers: on real doc-qa pairs (SmolLM2-135M) the
K/V of such a passage deviated 0.1-0.2 from cold in layers 16-20 while its layer-1 deviation
ranked it past the first 15% of tokens, and the held-out reference's perplexity was 1.07-1.12x
cold's until that passage was recomputed (docs/benchmarks.md, echoes). A token pair is a cheap
trace of that link: the tokens an echo starts are recomputed with those after it
(``recompute_echo_span``), in every layer, by the recompute policy.
"""

from __future__ import annotations

import numpy as np

from semshare_vllm.alignment.result import MatchKind

# A pair seen more often than this among the shared tokens is common text ("of the"), not the
# mention of one thing.
MAX_REPEATS = 3


def echo_starts(
    target: np.ndarray, donor: np.ndarray, donor_pos: np.ndarray, kind: np.ndarray
) -> np.ndarray:
    """Target positions starting a pair of exactly aligned tokens whose ids also form a pair in
    the target's unshared text (unaligned, or another token) or the donor's (no target token
    takes it), and at most ``MAX_REPEATS`` times among the target's shared pairs."""
    t = np.asarray(target, dtype=np.int64)
    d = np.asarray(donor, dtype=np.int64)
    if len(t) < 2:
        return np.zeros(0, dtype=np.int64)
    shared = (donor_pos >= 0) & (kind == MatchKind.EXACT)
    used = np.zeros(len(d), dtype=bool)
    used[donor_pos[donor_pos >= 0]] = True
    t_pairs, d_pairs = _pairs(t), _pairs(d)
    t_shared = shared[:-1] & shared[1:]
    unshared = np.concatenate(
        [t_pairs[~t_shared], d_pairs[~(used[:-1] & used[1:])] if len(d) > 1 else d_pairs]
    )
    if not len(unshared):
        return np.zeros(0, dtype=np.int64)
    values, counts = np.unique(t_pairs[t_shared], return_counts=True)
    rare = values[counts <= MAX_REPEATS]
    hit = t_shared & np.isin(t_pairs, rare) & np.isin(t_pairs, unshared)
    return np.flatnonzero(hit)


def _pairs(tokens: np.ndarray) -> np.ndarray:
    """One int64 per pair of neighbouring token ids (ids fit 32 bits)."""
    return (tokens[:-1] << 32) | (tokens[1:] & 0xFFFFFFFF)
