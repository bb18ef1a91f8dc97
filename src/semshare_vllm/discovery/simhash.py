"""64-bit SimHash of a token sequence (LLMCache's cheap fingerprint).

Each 4-token shingle is hashed to 64 bits; every bit of the fingerprint is the majority vote of
that bit over the shingles. Near-duplicate prompts (a few tokens changed) land within a few bits
of each other, so a Hamming-distance scan over a namespace finds them without embedding anything.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

SHINGLE = 4
_BITS = np.arange(64, dtype=np.uint64)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser: spreads every input bit over all 64 output bits."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def simhash(token_ids: Sequence[int] | np.ndarray) -> int:
    tokens = np.asarray(token_ids, dtype=np.uint64)
    if len(tokens) == 0:
        return 0
    n = max(len(tokens) - SHINGLE + 1, 1)
    h = np.zeros(n, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(min(SHINGLE, len(tokens))):  # combine the shingle's tokens in order
            h = _mix(h * np.uint64(0x9E3779B97F4A7C15) + tokens[j : j + n])
    bits = ((h[:, None] >> _BITS) & np.uint64(1)).astype(np.int32)
    votes = bits.sum(0) * 2 > n
    return int((votes.astype(np.uint64) << _BITS).sum())


def hamming(a: int | np.ndarray, b: int) -> np.ndarray:
    """Bit distance between fingerprint(s) ``a`` and fingerprint ``b``."""
    return np.bitwise_count(np.asarray(a, dtype=np.uint64) ^ np.uint64(b))
