"""Shared token 4-grams: a millisecond test of whether any donor could serve a prompt at all.

A semantic hit needs at least ``min_alignment_coverage`` (default 80%) of the claim aligned to
the *same* tokens, and same tokens come in runs: a donor that shares almost no token 4-gram with
a prompt cannot reach that, however close their embeddings. On real text unrelated documents
share almost none of their 4-grams, while an edited document keeps a clear share with its
original (figures: docs/benchmarks.md, "Discovery quality"). So a lookup first asks
``GramTable.top``: below the threshold
(``lookup_min_shared_grams``, 5%) it answers "nothing" without embedding the prompt, so a request
with no possible donor is not held back for the embedder; and a donor holding at least half of
the prompt's grams (the same document behind another instruction, the same passages reordered,
the next turn of a chat) is a candidate at once, also without an embedding (the alignment then
measures the coverage exactly).

Each donor keeps a content-defined quarter of its distinct 4-gram hashes (those whose hash is
0 mod 4, so that the same text samples the same grams at any offset). The table is a sorted
array of (hash, donor) over most donors plus a short list of recent ones, merged once it grows.
"""

from __future__ import annotations

from typing import Hashable, Sequence

import numpy as np

GRAM = 4
SAMPLE = 4  # keep hashes that are 0 mod SAMPLE
MERGE_AFTER = 64  # recent donors searched one by one before they join the sorted array


def sample_grams(token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """The sampled distinct 4-gram hashes of a token sequence (sorted uint64)."""
    tokens = np.asarray(token_ids, dtype=np.uint64)
    n = len(tokens) - GRAM + 1
    if n <= 0:
        return np.zeros(0, dtype=np.uint64)
    h = np.zeros(n, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(GRAM):
            h = (h * np.uint64(0x9E3779B97F4A7C15)) ^ tokens[j : j + n]
            h = (h * np.uint64(0xBF58476D1CE4E5B9)) ^ (h >> np.uint64(29))
    return np.unique(h[h % np.uint64(SAMPLE) == 0])


class GramTable:
    """One namespace's donors' sampled grams. Not thread-safe: the caller holds a lock."""

    def __init__(self):
        self._grams: dict[Hashable, np.ndarray] = {}
        self._recent: list[Hashable] = []
        self._hashes = np.zeros(0, dtype=np.uint64)  # sorted
        self._rows = np.zeros(0, dtype=np.int64)  # donor row of each hash
        self._row_keys: list[Hashable] = []

    def __len__(self) -> int:
        return len(self._grams)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._grams

    def add(self, key: Hashable, grams: np.ndarray) -> None:
        self._grams[key] = grams
        self._recent.append(key)
        if len(self._recent) > MERGE_AFTER:
            self._merge()

    def remove(self, key: Hashable) -> None:
        self._grams.pop(key, None)  # its merged rows are skipped until the next merge

    def top(self, grams: np.ndarray, k: int) -> list[tuple[Hashable, float]]:
        """The ``k`` donors holding the largest shares of ``grams``, best first (none: [])."""
        if len(grams) == 0 or not self._grams:
            return []
        held: dict[Hashable, int] = {}
        if len(self._hashes):
            left = np.searchsorted(self._hashes, grams, "left")
            lens = np.searchsorted(self._hashes, grams, "right") - left
            keep = lens > 0
            left, lens = left[keep], lens[keep]
            if len(lens):
                first = np.repeat(left - np.concatenate(([0], np.cumsum(lens)[:-1])), lens)
                counts = np.bincount(self._rows[first + np.arange(int(lens.sum()))])
                for row in np.flatnonzero(counts):
                    key = self._row_keys[row]
                    if key in self._grams:  # removed since the merge: skipped
                        held[key] = int(counts[row])
        for key in self._recent:
            mine = self._grams.get(key)
            if mine is not None:
                held[key] = max(
                    held.get(key, 0), int(np.isin(grams, mine, assume_unique=True).sum())
                )
        best = sorted(held.items(), key=lambda kv: -kv[1])[:k]
        return [(key, count / len(grams)) for key, count in best if count > 0]

    def _merge(self) -> None:
        self._row_keys = list(self._grams)
        arrays = [self._grams[k] for k in self._row_keys]
        hashes = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.uint64)
        rows = np.repeat(np.arange(len(arrays)), [len(a) for a in arrays])
        order = np.argsort(hashes, kind="stable")
        self._hashes, self._rows = hashes[order], rows[order]
        self._recent = []
