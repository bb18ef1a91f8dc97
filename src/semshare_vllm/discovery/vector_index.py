"""Cosine top-k search over donor vectors, one table per namespace.

A namespace is a hard filter by construction: each has its own table, and a search reads only
the table of its namespace (the empty namespace is a table like any other, never "all").

Search kinds (``index_kind`` in the config):

* ``exact``: numpy matrix-vector product over the table; results are exact.
* ``faiss-flat``: FAISS ``IndexFlatIP`` (exact, the same results as ``exact``).
* ``faiss-ivf``: FAISS ``IndexIVFFlat`` (approximate: ``nprobe`` of ``nlist`` lists are read),
  for very large namespaces; trained on the discovery thread, exact search until it is ready.
* ``auto``: ``exact`` up to ``exact_max`` donors in a namespace, ``faiss-ivf`` beyond.

FAISS tables stay on the CPU even with a GPU: donors leave one at a time, and FAISS's GPU indexes
cannot remove entries. Every table also keeps the 64-bit SimHash of each donor, for the
near-duplicate scan that needs no embedding, and its sampled token 4-grams (``ngrams``), for the
test that any donor could serve a prompt at all. A donor not embedded yet is offered by its grams
alone (``add_grams``): found by a prompt that holds most of them, never by meaning.

Thread-safety: one lock. The scheduler thread adds and removes (cheap), the discovery thread
searches and builds FAISS tables (the slow training runs outside the lock).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Hashable, Sequence

import numpy as np

from semshare_vllm.discovery.ngrams import GramTable, sample_grams
from semshare_vllm.discovery.simhash import hamming

logger = logging.getLogger("vllm.semshare.index")

KINDS = ("auto", "exact", "faiss-flat", "faiss-ivf")


@dataclass(frozen=True)
class Candidate:
    key: Hashable
    score: float  # cosine similarity, 1 - bits/64 for SimHash, the share of shared grams
    method: str  # "cosine", "simhash" or "grams"


class _Table:
    """One namespace: rows of unit vectors with their keys and fingerprints."""

    def __init__(self, dim: int):
        self.vectors = np.zeros((16, dim), dtype=np.float32)
        self.fingerprints = np.zeros(16, dtype=np.uint64)
        self.ids = np.zeros(16, dtype=np.int64)  # stable id of each row (FAISS ids)
        self.keys: list[Hashable] = []
        self.row_of: dict[Hashable, int] = {}
        self.key_of_id: dict[int, Hashable] = {}
        self.faiss = None  # FAISS index over the same rows, once built
        self.grams = GramTable()  # sampled token 4-grams of the donors that gave them
        self.faiss_size = 0  # rows when it was built (rebuild past 2x)

    def __len__(self) -> int:
        return len(self.keys)

    def add(self, key: Hashable, vector: np.ndarray, fingerprint: int, vid: int) -> None:
        n = len(self.keys)
        if n == len(self.vectors):
            self.vectors = np.concatenate([self.vectors, np.zeros_like(self.vectors)])
            self.fingerprints = np.concatenate(
                [self.fingerprints, np.zeros_like(self.fingerprints)]
            )
            self.ids = np.concatenate([self.ids, np.zeros_like(self.ids)])
        self.vectors[n] = vector
        self.fingerprints[n] = np.uint64(fingerprint)
        self.ids[n] = vid
        self.keys.append(key)
        self.row_of[key] = n
        self.key_of_id[vid] = key
        if self.faiss is not None:
            self.faiss.add_with_ids(vector[None, :], np.asarray([vid], dtype=np.int64))

    def remove(self, key: Hashable) -> None:
        self.grams.remove(key)
        row = self.row_of.pop(key)
        last = len(self.keys) - 1
        vid = int(self.ids[row])
        del self.key_of_id[vid]
        if row != last:  # move the last row into the hole
            self.vectors[row] = self.vectors[last]
            self.fingerprints[row] = self.fingerprints[last]
            self.ids[row] = self.ids[last]
            self.keys[row] = self.keys[last]
            self.row_of[self.keys[row]] = row
        self.keys.pop()
        if self.faiss is not None:
            self.faiss.remove_ids(np.asarray([vid], dtype=np.int64))


class VectorIndex:
    def __init__(
        self, dim: int = 384, kind: str = "auto", exact_max: int = 20_000, nprobe: int = 16
    ):
        if kind not in KINDS:
            raise ValueError(f"index kind {kind!r} not in {KINDS}")
        self.dim = dim
        self.kind = kind
        self.exact_max = exact_max
        self.nprobe = nprobe
        self._tables: dict[str, _Table] = {}
        self._lock = threading.Lock()
        self._next_id = 0

    def __len__(self) -> int:
        return sum(len(t) for t in self._tables.values())

    def size(self, namespace: str) -> int:
        """Donors of ``namespace`` with a vector (searchable by meaning)."""
        table = self._tables.get(namespace)
        return len(table) if table is not None else 0

    def has_donors(self, namespace: str) -> bool:
        """Whether any donor of ``namespace`` can be found, by meaning or by its grams."""
        table = self._tables.get(namespace)
        return table is not None and (len(table) > 0 or len(table.grams) > 0)

    def __contains__(self, item: tuple[str, Hashable]) -> bool:
        namespace, key = item
        table = self._tables.get(namespace)
        return table is not None and key in table.row_of

    # ---- mutation (scheduler thread) ----------------------------------------------------------
    def add_donor(
        self,
        namespace: str,
        key: Hashable,
        vector: np.ndarray,
        fingerprint: int,
        token_ids: Sequence[int],
    ) -> None:
        """Add a donor with the sampled 4-grams of its prompt (the catalog calls this: how
        prompts are sampled is discovery's business)."""
        self.add(namespace, key, vector, fingerprint, sample_grams(token_ids))

    def add_grams(self, namespace: str, key: Hashable, token_ids: Sequence[int]) -> None:
        """Offer a donor by its content alone (its prompt's sampled 4-grams) until its vector
        comes (``add_donor``): found by a prompt holding most of them, never by meaning."""
        grams = sample_grams(token_ids)
        with self._lock:
            table = self._table_for(namespace)
            if key not in table.row_of:
                table.grams.add(key, grams)

    def add(
        self,
        namespace: str,
        key: Hashable,
        vector: np.ndarray,
        fingerprint: int,
        grams: np.ndarray | None = None,
    ) -> None:
        """Add a donor: its vector, SimHash and (optional) sampled 4-grams (``ngrams``)."""
        vector = np.asarray(vector, dtype=np.float32).reshape(self.dim)
        with self._lock:
            table = self._table_for(namespace)
            if key in table.row_of:
                table.remove(key)
            self._next_id += 1
            table.add(key, vector, fingerprint, self._next_id)
            if grams is not None:
                table.grams.add(key, grams)

    def _table_for(self, namespace: str) -> _Table:
        """The namespace's table, made empty if it has none (under the lock)."""
        table = self._tables.get(namespace)
        if table is None:
            table = self._tables[namespace] = _Table(self.dim)
            if self.kind == "faiss-flat":
                table.faiss = self._flat()
        return table

    def remove(self, namespace: str, key: Hashable) -> bool:
        """Forget a donor (with a vector, or offered by its grams alone)."""
        with self._lock:
            table = self._tables.get(namespace)
            if table is None:
                return False
            if key in table.row_of:
                table.remove(key)
            elif key in table.grams:
                table.grams.remove(key)
            else:
                return False
            if not table.keys and not len(table.grams):
                del self._tables[namespace]
            return True

    # ---- search (discovery thread) ------------------------------------------------------------
    def search(
        self, namespace: str, vector: np.ndarray, k: int, threshold: float = -1.0
    ) -> list[Candidate]:
        """The ``k`` donors of ``namespace`` most similar with cosine >= ``threshold``, best
        first."""
        q = np.asarray(vector, dtype=np.float32).reshape(1, self.dim)
        with self._lock:
            table = self._tables.get(namespace)
            if table is None or k <= 0 or len(table) == 0:  # (grams-only donors: no rows)
                return []
            n = len(table)
            if table.faiss is not None:
                if hasattr(table.faiss, "nprobe"):
                    table.faiss.nprobe = self.nprobe
                scores, ids = table.faiss.search(q, min(k, n))
                found = [
                    (table.key_of_id[int(i)], float(s)) for s, i in zip(scores[0], ids[0]) if i >= 0
                ]
            else:
                scores = table.vectors[:n] @ q[0]
                top = np.argpartition(-scores, min(k, n) - 1)[:k] if n > k else np.arange(n)
                top = top[np.argsort(-scores[top], kind="stable")]
                found = [(table.keys[i], float(scores[i])) for i in top]
        return [Candidate(key, s, "cosine") for key, s in found if s >= threshold]

    def shared_grams(self, namespace: str, grams: np.ndarray, k: int) -> list[Candidate] | None:
        """The ``k`` donors of ``namespace`` holding the largest shares of a prompt's sampled
        4-grams (score = share), best first; None when no donor there gave its grams."""
        with self._lock:
            table = self._tables.get(namespace)
            if table is None or not len(table.grams):
                return None
            return [Candidate(key, share, "grams") for key, share in table.grams.top(grams, k)]

    def near_duplicates(self, namespace: str, fingerprint: int, max_bits: int) -> list[Candidate]:
        """Donors of ``namespace`` whose SimHash is within ``max_bits`` of ``fingerprint``."""
        with self._lock:
            table = self._tables.get(namespace)
            if table is None:
                return []
            d = hamming(table.fingerprints[: len(table)], fingerprint)
            rows = np.flatnonzero(d <= max_bits)
            rows = rows[np.argsort(d[rows], kind="stable")]
            return [Candidate(table.keys[r], 1.0 - float(d[r]) / 64, "simhash") for r in rows]

    # ---- FAISS tables (discovery thread) ------------------------------------------------------
    def build_pending(self, namespace: str | None = None) -> int:
        """Build (or rebuild, past twice the size trained on) the IVF tables of ``namespace`` (or
        of all namespaces) that need one. Training runs outside the lock; rows added meanwhile
        are included."""
        built = 0
        for ns in [namespace] if namespace is not None else list(self._tables):
            with self._lock:
                table = self._tables.get(ns)
                if table is None or not self._wants_ivf(table):
                    continue
                sample = table.vectors[: len(table)].copy()
            index = self._trained_ivf(sample)
            with self._lock:
                if self._tables.get(ns) is not table:
                    continue
                n = len(table)
                index.add_with_ids(table.vectors[:n], table.ids[:n].copy())
                table.faiss, table.faiss_size = index, n
            built += 1
            logger.info("SemShare: FAISS IVF table for a namespace of %d donors", n)
        return built

    def _wants_ivf(self, table: _Table) -> bool:
        if self.kind not in ("auto", "faiss-ivf"):
            return False
        n = len(table)
        big_enough = n > self.exact_max if self.kind == "auto" else n >= 256
        return big_enough and (table.faiss is None or n > 2 * table.faiss_size)

    def _trained_ivf(self, vectors: np.ndarray):
        import faiss

        n = len(vectors)
        nlist = int(min(max(4 * np.sqrt(n), 16), 1024, n // 8))
        quantizer = faiss.IndexFlatIP(self.dim)
        index = faiss.IndexIVFFlat(quantizer, self.dim, nlist, faiss.METRIC_INNER_PRODUCT)
        rng = np.random.default_rng(0)
        train = vectors if n <= 64 * nlist else vectors[rng.choice(n, 64 * nlist, replace=False)]
        index.train(train)
        index.nprobe = self.nprobe
        # Donors leave one at a time on the scheduler thread: an id -> list map makes each
        # removal O(1) instead of a scan of every list (docs/benchmarks.md, "Discovery speed").
        index.set_direct_map_type(faiss.DirectMap.Hashtable)
        return index

    def _flat(self):
        import faiss

        return faiss.IndexIDMap2(faiss.IndexFlatIP(self.dim))
