"""``align``: the one entry of the alignment stage. Target token -> donor token, in stages.

1. exact: token-identical runs at any offset (reordered passages, shifted documents), cut at
   sentence boundaries when they spill a few tokens across one;
2. edit: the gaps between runs edit-aligned with their donor counterparts (edited documents);
3. sentence: mostly unaligned target sentences paired with their most similar donor sentence,
   anywhere, and edit-aligned (reworded or moved sentences);
4. lsh: whatever is left goes to its nearest donor token by SemShareKV's LSH on RoPE-rotated
   input embeddings, if near enough.

Each stage only fills positions the earlier ones left free. Stages 3-4 need the model's input
embeddings (``EmbeddingTable``) and stage 3 a ``SentenceSplitter``; without them those stages
are skipped. ``stages=("lsh",)`` is the paper's matching alone.

What depends on the donor alone (its LSH codes, its sentences and their vectors) is a
``DonorFeatures``: computed on first use, and worth keeping with the donor, so that a hit pays
only for the target's side.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from semshare_vllm.alignment.edits import edit_stage
from semshare_vllm.alignment.embedding_table import EmbeddingTable
from semshare_vllm.alignment.exact_runs import MIN_RUN, align_exact
from semshare_vllm.alignment.lsh import LshParams, lsh_codes, lsh_stage
from semshare_vllm.alignment.result import Alignment, AlignmentBuilder, MatchKind
from semshare_vllm.alignment.sentences import SentenceSplitter, sentence_stage, sentence_vectors
from semshare_vllm.config import AlignmentConfig


@dataclass(frozen=True)
class AlignParams:
    stages: tuple[str, ...] = ("exact", "edit", "sentence", "lsh")
    min_run: int = MIN_RUN
    sentence_snap: int = 4
    edit_min_similarity: float = 0.3
    sentence_min_similarity: float = 0.8
    lsh: LshParams = field(default_factory=LshParams)

    @classmethod
    def from_config(cls, config: AlignmentConfig) -> "AlignParams":
        """From the config's alignment section (a ``SemShareConfig`` is one), which has
        validated every key: nothing is checked again here."""
        return cls(
            stages=config.stages(),
            min_run=config.align_min_run,
            sentence_snap=config.align_sentence_snap,
            edit_min_similarity=config.edit_min_similarity,
            sentence_min_similarity=config.sentence_min_similarity,
            lsh=LshParams(
                bits=config.lsh_bits,
                tables=config.lsh_tables,
                max_distance=config.lsh_max_distance,
                rope_style=config.lsh_rope_style,
                rope_base=config.lsh_rope_base or None,
            ),
        )


class DonorFeatures:
    """The donor's side of an alignment, each part computed once, when first needed."""

    def __init__(
        self,
        tokens: Sequence[int] | np.ndarray,
        table: EmbeddingTable | None = None,
        splitter: SentenceSplitter | None = None,
        lsh: LshParams = LshParams(),
    ):
        self.tokens = np.asarray(tokens, dtype=np.int64)
        self.table, self.splitter, self.lsh = table, splitter, lsh

    @functools.cached_property
    def codes(self) -> np.ndarray:
        """LSH codes of every donor token at its own position."""
        return lsh_codes(self.table, self.tokens, np.arange(len(self.tokens)), self.lsh)

    @functools.cached_property
    def sentences(self) -> tuple[np.ndarray, np.ndarray]:
        """(start of each sentence, its vector)."""
        starts = self.splitter.starts(self.tokens)
        return starts, sentence_vectors(self.table, self.tokens, starts)

    def warm(self) -> "DonorFeatures":
        """Compute every part the table and splitter allow (off the hit path)."""
        if self.table is not None:
            _ = self.codes
            if self.splitter is not None:
                _ = self.sentences
        return self


def _empty(n: int) -> Alignment:
    return Alignment(np.full(n, -1, dtype=np.int64), np.full(n, MatchKind.NONE, dtype=np.int8), ())


def align(
    target: Sequence[int] | np.ndarray,
    donor: Sequence[int] | np.ndarray | DonorFeatures,
    params: AlignParams = AlignParams(),
    table: EmbeddingTable | None = None,
    splitter: SentenceSplitter | None = None,
) -> Alignment:
    """Align ``target`` to ``donor`` (token ids, or the donor's kept ``DonorFeatures``)."""
    if not isinstance(donor, DonorFeatures):
        donor = DonorFeatures(donor, table, splitter, params.lsh)
    elif donor.lsh != params.lsh:
        raise ValueError("the donor's features were made with other LSH parameters")
    t = np.asarray(target, dtype=np.int64)
    d = donor.tokens
    if "exact" in params.stages:
        starts = splitter.start_mask(t) if splitter is not None else None
        result = align_exact(
            t, d, params.min_run, sentence_starts=starts, snap=params.sentence_snap
        )
    else:
        result = _empty(len(t))
    builder = AlignmentBuilder(result)
    for stage in params.stages:
        if not builder.free.any():
            break
        if stage == "edit":
            edit_stage(builder, t, d, params.edit_min_similarity)
        elif stage == "sentence" and table is not None and splitter is not None:
            starts, vectors = donor.sentences
            sentence_stage(
                builder,
                t,
                d,
                starts,
                vectors,
                table,
                splitter,
                params.sentence_min_similarity,
                params.edit_min_similarity,
            )
        elif stage == "lsh" and table is not None:
            lsh_stage(builder, t, d, table, params.lsh, donor.codes)
    return builder.build()
