"""How close a generated answer is to a reference one."""

from __future__ import annotations

from rapidfuzz.distance import LCSseq


def rouge_l(candidate: str, reference: str) -> float:
    """ROUGE-L F1 over whitespace words (longest common subsequence)."""
    c, r = candidate.split(), reference.split()
    if not c or not r:
        return float(c == r)
    lcs = LCSseq.similarity(c, r)
    if lcs == 0:
        return 0.0
    p, rec = lcs / len(c), lcs / len(r)
    return 2 * p * rec / (p + rec)
