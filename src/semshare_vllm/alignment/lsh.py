"""SemShareKV fuzzy token matching: SimHash LSH over RoPE-augmented input embeddings.

A token's "E cache" vector is its input-embedding row. Rotated by RoPE at the token's position
(the model's rotary base, neox or GPT-J pairing), the same token at nearby positions stays close
while far-apart occurrences drift apart, so the nearest donor token by LSH is a similar token at
a similar place (SemShareKV §4.3.1-4.3.2, appendix A.1). Codes are random-hyperplane SimHash:
``tables`` independent sets of ``bits`` hyperplanes, concatenated; the distance between two
tokens is the Hamming distance over all tables. The nearest donor token is found with FAISS's
binary flat index (exact Hamming search, popcount-vectorised).

Parameters the paper leaves open (see README, "Alignment"): bits per table, number of tables,
the hyperplane seed, the RoPE pairing and base, the largest distance accepted, and how ties are
broken (optionally: the candidate nearest the position the neighbouring alignment predicts;
on reworded text it changed nothing that mattered and makes the search slower, so it is off by
default; figures in docs/architecture.md, "Alignment").

``lsh_similarity`` is the paper's prompt-level score (appendix A.3):
``clip(1 - (d - min_dist) / (max_dist - min_dist), 0, 1)``, d = the mean over target tokens of
the Hamming distance to the nearest donor token, per table; min_dist 0, max_dist 30.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from semshare_vllm.alignment.embedding_table import EmbeddingTable
from semshare_vllm.alignment.result import AlignmentBuilder, MatchKind
from semshare_vllm.config.alignment import check_lsh


@dataclass(frozen=True)
class LshParams:
    bits: int = 32  # hyperplanes per table (max_dist = 30 suggests ~32-bit codes)
    tables: int = 2  # independent tables, distances summed
    seed: int = 1234
    rope_style: str = "neox"  # "neox" (vLLM's Llama/Qwen/Mistral), "gptj" (paper eq. 1), "none"
    rope_base: float | None = None  # None: the model's rope_theta
    max_distance: float = 0.25  # accept a fuzzy match up to this fraction of differing bits
    candidates: int = 1  # nearest codes examined; > 1 breaks ties by predicted position
    min_dist: float = 0.0  # appendix A.3 normalisation, per table
    max_dist: float = 30.0

    def __post_init__(self):
        # the config's rules (one place), for parameters built without a config;
        # SemShareConfigError is a ValueError
        check_lsh(self.bits, self.tables, self.rope_style)

    @property
    def total_bits(self) -> int:
        return self.bits * self.tables


def rope_rotate(
    vectors: torch.Tensor, positions: np.ndarray, base: float, style: str = "neox"
) -> torch.Tensor:
    """RoPE over the whole vector (pairs across all dims), angle ``pos * base**(-2i/dim)``."""
    if style == "none":
        return vectors
    dim = vectors.shape[1] - vectors.shape[1] % 2
    half = dim // 2
    positions = np.asarray(positions, dtype=np.int64)
    length = int(positions.max()) + 1 if len(positions) else 1
    if length > _TABLE_MAX:  # very long prompts: these positions' angles only
        angle = torch.from_numpy(positions.astype(np.float64))[:, None] * _inv_freq(base, dim)
        cos, sin = angle.cos().float(), angle.sin().float()
    else:
        cos, sin = _cos_sin(base, dim, length)
        first = int(positions[0]) if len(positions) else 0
        if (
            len(positions)
            and positions[-1] - first == len(positions) - 1
            and (np.diff(positions) == 1).all()
        ):
            cos, sin = cos[first : first + len(positions)], sin[first : first + len(positions)]
        else:
            pos = torch.from_numpy(positions)
            cos, sin = cos[pos], sin[pos]
    if style == "neox":
        a, b = vectors[:, :half], vectors[:, half:dim]
        parts = [a * cos - b * sin, b * cos + a * sin]
    else:
        a, b = vectors[:, 0:dim:2], vectors[:, 1:dim:2]
        parts = [torch.stack([a * cos - b * sin, b * cos + a * sin], dim=2).flatten(1)]
    return torch.cat(parts + [vectors[:, dim:]], dim=1)


# Positions up to this get a kept cos / sin table (SmolLM2: 38 MB at 16K); beyond, the angles of
# the positions asked for are computed each time.
_TABLE_MAX = 16384
_tables: dict[tuple[float, int], tuple[torch.Tensor, torch.Tensor]] = {}


def _inv_freq(base: float, dim: int) -> torch.Tensor:
    return base ** (-torch.arange(dim // 2, dtype=torch.float64) * 2 / dim)


def _cos_sin(base: float, dim: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin of every position's angles, fp32 from fp64; grown by doubling, kept."""
    have = _tables.get((base, dim))
    if have is None or len(have[0]) < length:
        size = min(_TABLE_MAX, max(4096, 1 << (length - 1).bit_length()))
        angle = torch.arange(size, dtype=torch.float64)[:, None] * _inv_freq(base, dim)
        have = _tables[(base, dim)] = (angle.cos().float(), angle.sin().float())
    return have


@functools.lru_cache(maxsize=8)
def _planes(dim: int, total_bits: int, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return torch.from_numpy(rng.standard_normal((dim, total_bits)).astype(np.float32))


def lsh_codes(table: EmbeddingTable, token_ids, positions, params: LshParams) -> np.ndarray:
    """``[N, total_bits / 8]`` uint8 SimHash codes of the tokens at their positions."""
    base = params.rope_base or table.rope_base
    rows = torch.from_numpy(table.rows(token_ids))
    e = rope_rotate(rows, np.asarray(positions), base, params.rope_style)
    bits = (e @ _planes(table.dim, params.total_bits, params.seed) > 0).numpy()
    return np.packbits(bits, axis=1)


def nearest(queries: np.ndarray, codes: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Hamming distances and indices of the ``k`` nearest ``codes`` to each query."""
    import faiss

    # One thread: more contend with torch's pool and are slower (docs/benchmarks.md,
    # "Alignment"). Only this thread's setting changes.
    faiss.omp_set_num_threads(1)
    index = faiss.IndexBinaryFlat(codes.shape[1] * 8)
    index.add(np.ascontiguousarray(codes))
    dist, idx = index.search(np.ascontiguousarray(queries), min(k, len(codes)))
    return dist.astype(np.int64), idx.astype(np.int64)


def lsh_similarity(table: EmbeddingTable, target, donor, params: LshParams = LshParams()) -> float:
    """SemShareKV's prompt similarity (appendix A.3): a full nearest search of every target
    token, so it costs what the fuzzy stage costs with nothing aligned before it."""
    t, d = np.asarray(target), np.asarray(donor)
    if not len(t) or not len(d):
        return 0.0
    dist, _ = nearest(
        lsh_codes(table, t, np.arange(len(t)), params),
        lsh_codes(table, d, np.arange(len(d)), params),
        1,
    )
    lsh_dist = float(dist[:, 0].mean()) / params.tables
    norm = (lsh_dist - params.min_dist) / (params.max_dist - params.min_dist)
    return float(np.clip(1.0 - norm, 0.0, 1.0))


def expected_donor_pos(donor_pos: np.ndarray, targets: np.ndarray, donor_len: int) -> np.ndarray:
    """Where the alignment around each target position predicts its donor token: the offset of
    the nearest aligned position to the left (else to the right); proportional with none."""
    n = len(donor_pos)
    aligned = donor_pos >= 0
    if not aligned.any():
        return targets * donor_len // max(n, 1)
    idx = np.arange(n)
    left = np.maximum.accumulate(np.where(aligned, idx, -1))
    right = np.minimum.accumulate(np.where(aligned, idx, n)[::-1])[::-1]
    ref = np.where(left[targets] >= 0, left[targets], right[targets])
    return np.clip(targets + donor_pos[ref] - ref, 0, donor_len - 1)


def lsh_stage(
    builder: AlignmentBuilder,
    target: np.ndarray,
    donor: np.ndarray,
    table: EmbeddingTable,
    params: LshParams,
    donor_codes: np.ndarray | None = None,
) -> int:
    """Map every still-free target token to its nearest donor token (within ``max_distance``).
    ``donor_codes`` (from ``lsh_codes`` at the donor's own positions) may be passed in cached."""
    free = np.flatnonzero(builder.free)
    if not len(free) or not len(donor):
        return 0
    if donor_codes is None:
        donor_codes = lsh_codes(table, donor, np.arange(len(donor)), params)
    dist, idx = nearest(
        lsh_codes(table, target[free], free, params), donor_codes, params.candidates
    )
    best = np.zeros(len(free), dtype=np.int64)
    if idx.shape[1] > 1:  # among the best-distance candidates, the nearest predicted position
        expect = expected_donor_pos(builder.donor_pos, free, len(donor))
        score = dist * (2 * len(donor) + 1) + np.abs(idx - expect[:, None])
        best = np.argmin(np.where(idx >= 0, score, np.iinfo(np.int64).max), axis=1)
    rows = np.arange(len(free))
    d, j = dist[rows, best], idx[rows, best]
    ok = (j >= 0) & (d <= params.max_distance * params.total_bits)
    same = donor[j[ok]] == target[free[ok]]
    kind = np.where(same, MatchKind.EXACT, MatchKind.FUZZY).astype(np.int8)
    return builder.take("lsh", free[ok], j[ok], kind)
