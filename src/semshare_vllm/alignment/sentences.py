"""Sentence units (SentenceKV's idea, used across requests): align whole sentences first.

Both prompts are cut into sentences at tokens that end one (".", "!", "?", a newline; found once
per tokenizer by decoding the vocabulary). Each sentence gets a vector: the mean of its tokens'
input embeddings with what all tokens share removed (the vocabulary's mean and top principal
directions, ``EmbeddingTable.common_directions``; else all sentences look alike), normalised.
A target sentence that the earlier stages left mostly unaligned is paired with its most similar
donor sentence, anywhere in the donor (moved and reworded sentences), and the pair is
edit-aligned token by token.
"""

from __future__ import annotations

import numpy as np

from semshare_vllm.alignment.edits import edit_map, take_edit_map
from semshare_vllm.alignment.embedding_table import EmbeddingTable
from semshare_vllm.alignment.result import AlignmentBuilder

_ENDINGS = (".", "!", "?", "\n", "。", "！", "？")


class SentenceSplitter:
    def __init__(self, end_ids):
        self.end_ids = np.unique(np.asarray(list(end_ids), dtype=np.int64))

    @classmethod
    def from_tokenizer(cls, tokenizer) -> "SentenceSplitter":
        """Token ids whose text ends a sentence (trailing spaces ignored) or holds a newline."""
        texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
        return cls(i for i, s in enumerate(texts) if "\n" in s or s.rstrip(" ").endswith(_ENDINGS))

    def starts(self, tokens: np.ndarray) -> np.ndarray:
        """Start index of every sentence (the first is 0); a run of ending tokens ("!" then a
        newline) closes one sentence."""
        is_end = np.isin(tokens, self.end_ids)
        ends = np.flatnonzero(is_end[:-1] & ~is_end[1:]) + 1
        return np.r_[0, ends] if len(tokens) else np.zeros(0, dtype=np.int64)

    def start_mask(self, tokens: np.ndarray) -> np.ndarray:
        mask = np.zeros(len(tokens), dtype=bool)
        mask[self.starts(tokens)] = True
        return mask


def sentence_vectors(
    table: EmbeddingTable, tokens: np.ndarray, starts: np.ndarray, stops: np.ndarray | None = None
) -> np.ndarray:
    """``[len(starts), dim]`` normalised mean embedding, common part removed, of each sentence
    ``tokens[starts[i]:stops[i]]`` (``stops``: the next sentence's start by default)."""
    if stops is None:
        stops = np.r_[starts[1:], len(tokens)]
    lengths = stops - starts
    offsets = np.r_[0, np.cumsum(lengths)[:-1]]
    # the token indices of just these sentences, gathered once
    idx = np.repeat(starts - offsets, lengths) + np.arange(int(lengths.sum()))
    sums = np.add.reduceat(table.rows(tokens[idx]), offsets, axis=0)
    mean, top = table.common_directions
    v = sums / lengths[:, None] - mean
    v -= (v @ top) @ top.T
    return v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-6)


# Sentence pairs compared at most (the similarity matrix: 64 MB): prose of 32K tokens has about
# 1,300 sentences a side; only short lines come near it.
SENTENCE_MAX_PAIRS = 16_000_000


def sentence_stage(
    builder: AlignmentBuilder,
    target: np.ndarray,
    donor: np.ndarray,
    donor_starts: np.ndarray,
    donor_vectors: np.ndarray,
    table: EmbeddingTable,
    splitter: SentenceSplitter,
    min_similarity: float,
    edit_min_similarity: float,
    min_free: float = 0.5,
) -> int:
    """Pair each mostly unaligned target sentence with its most similar donor sentence
    (``donor_starts`` / ``donor_vectors``: the donor's sentences, see ``DonorFeatures``)."""
    if not len(target) or not len(donor):
        return 0
    t_starts = splitter.starts(target)
    t_stops = np.r_[t_starts[1:], len(target)]
    free_share = np.add.reduceat(builder.free.astype(np.float32), t_starts) / (t_stops - t_starts)
    chosen = np.flatnonzero(free_share >= min_free)
    if not len(chosen):
        return 0
    if len(chosen) * len(donor_vectors) > SENTENCE_MAX_PAIRS:
        return 0  # short lines (logs, tables): thousands of "sentences" a side
    tv = sentence_vectors(table, target, t_starts[chosen], t_stops[chosen])
    sims = tv @ donor_vectors.T
    best = sims.argmax(axis=1)
    d_stops = np.r_[donor_starts[1:], len(donor)]
    taken = 0
    for row, (i, j) in enumerate(zip(chosen.tolist(), best.tolist())):  # sentences, not tokens
        if sims[row, j] < min_similarity:
            continue
        a, b, lo, hi = t_starts[i], t_stops[i], donor_starts[j], d_stops[j]
        mapping = edit_map(target[a:b], donor[lo:hi], edit_min_similarity)
        if mapping is not None:
            taken += take_edit_map(builder, "sentence", int(a), int(lo), mapping)
    return taken
