"""The alignment of a target prompt to a donor prompt, position by position."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import numpy as np


class MatchKind(IntEnum):
    NONE = 0     # computed, no donor KV
    EXACT = 1    # inside a token-identical run
    FUZZY = 2    # nearest donor token by LSH (not yet)


@dataclass(frozen=True)
class Run:
    """``target[t:t+length] == donor[d:d+length]``."""

    target_start: int
    donor_start: int
    length: int

    @property
    def offset(self) -> int:
        return self.donor_start - self.target_start


@dataclass(frozen=True)
class Alignment:
    donor_pos: np.ndarray     # [target_len] int64: donor position, or -1
    kind: np.ndarray          # [target_len] int8: MatchKind
    confidence: np.ndarray    # [target_len] float32 in [0, 1]
    runs: tuple[Run, ...]     # the exact runs used, in target order

    @property
    def coverage(self) -> float:
        """Fraction of target positions that take donor KV."""
        return float((self.donor_pos >= 0).mean()) if len(self.donor_pos) else 0.0

    @property
    def exact_coverage(self) -> float:
        return float((self.kind == MatchKind.EXACT).mean()) if len(self.kind) else 0.0

    @property
    def num_runs(self) -> int:
        return len(self.runs)
