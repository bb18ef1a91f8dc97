"""The alignment of a target prompt to a donor prompt, position by position."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np


class MatchKind(IntEnum):
    NONE = 0  # computed, no donor KV
    EXACT = 1  # the donor token is the same token (a run, or an equal piece of an edit)
    FUZZY = 2  # a different donor token: a replaced word of an edit, or the LSH nearest


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
    donor_pos: np.ndarray  # [target_len] int64: donor position, or -1
    kind: np.ndarray  # [target_len] int8: MatchKind
    runs: tuple[Run, ...]  # the token-identical runs used, in target order
    # Positions each stage aligned, by stage name ("exact", "edit", "sentence", "lsh").
    stage_counts: dict[str, int] = field(default_factory=dict)
    # Target positions starting an echo of the text the prompts do not share: set only on the
    # chosen donor's alignment, when the recompute asks for them (echoes.with_echoes).
    echoes: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    @property
    def coverage(self) -> float:
        """Fraction of target positions that take donor KV."""
        return float((self.donor_pos >= 0).mean()) if len(self.donor_pos) else 0.0

    @property
    def exact_coverage(self) -> float:
        return float((self.kind == MatchKind.EXACT).mean()) if len(self.kind) else 0.0

    @property
    def fuzzy_coverage(self) -> float:
        return float((self.kind == MatchKind.FUZZY).mean()) if len(self.kind) else 0.0

    @property
    def num_runs(self) -> int:
        return len(self.runs)

    def summary(self) -> dict:
        return {
            "tokens": len(self.donor_pos),
            "coverage": round(self.coverage, 4),
            "exact_coverage": round(self.exact_coverage, 4),
            "fuzzy_coverage": round(self.fuzzy_coverage, 4),
            "runs": self.num_runs,
            **{f"by_{k}": v for k, v in self.stage_counts.items()},
        }


class AlignmentBuilder:
    """Mutable arrays the stages fill in turn; a stage only ever takes free positions."""

    def __init__(self, start: Alignment):
        self.donor_pos = start.donor_pos.copy()
        self.kind = start.kind.copy()
        self.runs = list(start.runs)
        self.stage_counts = dict(start.stage_counts)

    @property
    def free(self) -> np.ndarray:
        return self.donor_pos < 0

    def take(
        self, stage: str, target_pos: np.ndarray, donor_pos: np.ndarray, kind: np.ndarray | int
    ) -> int:
        """Assign the still-free ones of ``target_pos``; returns how many were taken."""
        target_pos = np.asarray(target_pos, dtype=np.int64)
        keep = self.donor_pos[target_pos] < 0
        t = target_pos[keep]
        self.donor_pos[t] = (
            np.asarray(donor_pos, dtype=np.int64)[keep] if np.ndim(donor_pos) else donor_pos
        )
        self.kind[t] = np.asarray(kind)[keep] if np.ndim(kind) else kind
        self.stage_counts[stage] = self.stage_counts.get(stage, 0) + len(t)
        return len(t)

    def build(self) -> Alignment:
        return Alignment(
            self.donor_pos,
            self.kind,
            tuple(sorted(self.runs, key=lambda r: r.target_start)),
            self.stage_counts,
        )
