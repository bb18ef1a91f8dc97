"""Semantic hits: align the candidate donors discovery found, pick one, plan the claim.

``Aligner.warm`` (at start-up, on the lookup thread) and ``Aligner.prepare`` (per new donor, on
the background thread) run ahead of hits, so that a hit pays for the target's side of the
alignment only.
``Aligner.best`` runs on the discovery thread (never the scheduler's): it aligns the request's
tokens to each candidate donor's tokens (``alignment.align``) and returns the candidate whose
alignment covers most of what the request could claim. ``plan_claim`` (scheduler thread) turns
that into a ``SemanticPlan``: claim every position from vLLM's own prefix-cache hit up to the
last prompt token (vLLM computes that one), with the donor position of each (-1: none) and the
positions the recompute policy must always redo (``policy.always_recompute``). A plan is only
made when the worker can repair (its layer runner is ready) and enough of the claim is aligned;
otherwise the request is a miss for semantics (an exact prefix may still be served).
"""

from __future__ import annotations

import collections
import logging
import threading
from dataclasses import dataclass
from typing import Hashable

import numpy as np

from semshare_vllm.alignment import (
    Alignment,
    AlignParams,
    DonorFeatures,
    EmbeddingTable,
    MatchKind,
    SentenceSplitter,
    align,
    with_echoes,
)
from semshare_vllm.recompute.policy import always_recompute

logger = logging.getLogger("vllm.semshare.planner")

KEPT_DONORS = 256  # donors whose alignment features the discovery thread keeps (LRU)


@dataclass
class SemanticPlan:
    key: Hashable
    start: int  # first claimed position (vLLM's own prefix-cache hit ends here)
    end: int  # one past the last claimed position
    donor_pos: list[int]  # per claimed position: the donor position, or -1
    always: list[int]  # claimed positions the recompute must redo in every layer
    exact_tokens: int  # claimed positions taking the same token's KV
    fuzzy_tokens: int  # claimed positions taking another token's KV (always redone)

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    def truncated(self, num_tokens: int) -> "SemanticPlan":
        """The plan's first ``num_tokens`` positions (vLLM may take less than offered), with the
        new last position always recomputed; the token counts stay the full plan's."""
        end = self.start + num_tokens
        pos = np.asarray(self.donor_pos[:num_tokens])
        return SemanticPlan(
            self.key,
            self.start,
            end,
            pos.tolist(),
            [p for p in self.always if p < end] + [end - 1],
            self.exact_tokens,
            self.fuzzy_tokens,
        )


class Aligner:
    """What the alignment needs in the scheduler process (the input-embedding table, the
    sentence splitter), loaded once, lazily, on the discovery thread."""

    def __init__(
        self,
        params: AlignParams,
        model_path: str | None,
        tokenizer_path: str | None,
        sketch_dim: int = -1,
        echoes: bool = False,
    ):
        self.params = params
        self.echoes = echoes  # the winner's echoes, for recompute_echo_span > 0
        self._model_path, self._tokenizer_path = model_path, tokenizer_path
        self._sketch = sketch_dim
        self._loaded = False
        self._load_lock = threading.Lock()  # the table loads once, whichever thread asks first
        self._lock = threading.Lock()  # guards _kept
        self.table: EmbeddingTable | None = None
        self.splitter: SentenceSplitter | None = None
        self._kept: collections.OrderedDict[Hashable, DonorFeatures] = collections.OrderedDict()

    def _load(self) -> None:
        with self._load_lock:
            if self._loaded:
                return
            self._loaded = True
            try:
                if self._model_path:
                    self.table = EmbeddingTable.load(self._model_path, self._sketch)
            except Exception as exc:  # alignment goes on with the exact and edit stages
                logger.warning(
                    "SemShare: no input embeddings for alignment (%s); the sentence "
                    "and LSH stages are off",
                    exc,
                )
            try:
                if self._tokenizer_path:
                    from transformers import AutoTokenizer

                    tok = AutoTokenizer.from_pretrained(self._tokenizer_path)
                    self.splitter = SentenceSplitter.from_tokenizer(tok)
            except Exception as exc:
                logger.warning("SemShare: no tokenizer for sentence units (%s)", exc)

    def warm(self) -> None:
        """Load the table and splitter and run one small alignment through every stage, so that
        the first hit pays for none of it (background thread, at start-up): the sentence
        stage's common directions, the LSH stage's FAISS import and angle table took 220 ms on
        a first hit, past the lookup deadline. The target shares no token with its donor:
        a stage runs only on what the earlier ones left."""
        self._load()
        donor = np.arange(1000, 1200, dtype=np.int64)
        align(donor + 1000, donor, self.params, self.table, self.splitter)

    def prepare(self, key: Hashable, tokens: list[int]) -> None:
        """Compute a new donor's features ahead of its first hit (background thread), from
        the tokens every alignment to it passes too: its prompt (``SemanticSearch._align``)."""
        self._load()
        self._features(key, tokens, compute=True)

    def _features(self, key: Hashable, tokens: list[int], compute: bool = False) -> DonorFeatures:
        """The donor's side of alignments (LSH codes, sentence vectors), kept for the most
        recently used donors: a donor id is a hash of its tokens, so an entry goes stale only
        where the same id comes with another prompt length (below). Used from the lookup and
        the background thread."""
        with self._lock:
            features = self._kept.pop(key, None)
        if features is not None and len(features.tokens) != len(tokens):
            # the same donor with another prompt length: one restored from disk keeps no
            # prompt length (all its tokens), the same text captured again does
            features = None
        if features is None:
            features = DonorFeatures(tokens, self.table, self.splitter, self.params.lsh)
            if compute:
                features.warm()
        with self._lock:
            self._kept[key] = features
            while len(self._kept) > KEPT_DONORS:
                self._kept.popitem(last=False)
        return features

    def best(
        self, target: list[int], start: int, donors: list[tuple[Hashable, list[int]]]
    ) -> tuple[Hashable, Alignment] | None:
        """The donor whose alignment covers most of ``target[start:-1]`` (with its echoes, if
        asked for: for the winner only)."""
        self._load()
        best, best_cov = None, -1.0
        for key, tokens in donors:
            al = align(target, self._features(key, tokens), self.params, self.table, self.splitter)
            cov = coverage(al, start, len(target) - 1)
            if cov > best_cov:
                best, best_cov = (key, al, tokens), cov
        if best is None:
            return None
        key, al, tokens = best
        return key, with_echoes(al, target, tokens) if self.echoes else al


def plan_claim(
    key: Hashable,
    al: Alignment,
    start: int,
    end: int,
    run_head: int,
    tail: int,
    echo_span: int = 0,
    echo_max_share: float = 1.0,
) -> SemanticPlan:
    """Claim ``[start, end)`` of the request from donor ``key`` aligned by ``al``."""
    loaded = np.arange(start, end)
    donor_pos = al.donor_pos[start:end]
    same = al.kind == MatchKind.EXACT
    always = always_recompute(
        loaded, al.donor_pos, same, run_head, tail, al.echoes, echo_span, echo_max_share
    )
    aligned = donor_pos >= 0
    exact = int((aligned & same[start:end]).sum())
    return SemanticPlan(
        key, start, end, donor_pos.tolist(), always.tolist(), exact, int(aligned.sum()) - exact
    )


def coverage(al: Alignment, start: int, end: int) -> float:
    """Share of ``[start, end)`` aligned to the same token (different tokens' KV is measured to
    be no better than a random token's, so only same-token alignment counts as reuse)."""
    if end <= start:
        return 0.0
    span = slice(start, end)
    return float(((al.donor_pos[span] >= 0) & (al.kind[span] == MatchKind.EXACT)).mean())
