"""The scheduler's catalog of donors: what exists, in which namespace, and which prefix it shares.

The catalog is authoritative for what the host store holds: it does the byte accounting, asks the
eviction policy (``eviction.py``) for victims, and the worker drops what it is told to. A donor's
embedding enters the vector index (``discovery/vector_index.py``) through the catalog and leaves
it with the donor, so there is never a vector without KV nor KV the search cannot see.
Namespaces are separate dictionaries (and separate vector tables), so a lookup in one namespace
cannot see another's donors; the empty namespace is a namespace like any.

Exact-prefix matching uses a chain hash per block of ``block_size`` tokens
(``core.keys.block_hashes``): the hash of block i covers tokens [0, (i+1) * block_size), so the
longest run of equal hashes is the longest block-aligned common prefix.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

from semshare_vllm.catalog.eviction import EvictionPolicy
from semshare_vllm.core.keys import DonorKey, block_hashes

if TYPE_CHECKING:
    from semshare_vllm.discovery.embedder import DocumentEmbedding
    from semshare_vllm.discovery.vector_index import VectorIndex


@dataclass(eq=False)  # identity: records hold numpy arrays
class DonorRecord:
    key: DonorKey
    token_ids: list[int]
    nbytes: int
    hashes: list[bytes] = field(repr=False)
    num_prompt_tokens: int | None = None  # the prompt's share of token_ids (None: all)
    # another instance's donor: per rank, the digest of its KV shard (shared_records.kv_digest)
    kv_digests: list[str] | None = None
    hits: int = 0
    created: float = 0.0  # set by the catalog (its clock), like these two:
    last_used: float = 0.0
    serial: int = 0  # tells a re-added donor from its earlier self
    # discovery: set once the donor is embedded (off the scheduler thread)
    embedding: "DocumentEmbedding | None" = field(default=None, repr=False)
    fingerprint: int | None = None
    # quality, reported by the recompute stage
    deviation_reports: int = 0
    deviation: float = 0.0
    demoted: bool = False
    escalations: int = 0  # prompts whose load from it the recompute gate widened or declined
    # those prompts' digests (``ServedPrompt``), each with whether its load was declined: it
    # is not offered to them again
    withheld_from: dict[int, bool] = field(default_factory=dict, repr=False)

    def withheld(self, digest: int, scoring: bool) -> bool:
        """Whether the donor is kept from a request serving the prompt of ``digest``
        (``ServedPrompt``): that prompt's load from it escalated or was declined, and would
        again (sent again through ``vllm serve``, a target escalated at each load); vLLM computes
        it instead, and keeps it as a donor of its own. A request scoring that prompt's
        continuation measures what served the prompt: the donor where its load escalated (and
        was served), vLLM's own computation where it was declined."""
        declined = self.withheld_from.get(digest)
        return declined is not None and (declined or not scoring)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]


@dataclass(frozen=True)
class PrefixMatch:
    key: DonorKey
    num_tokens: int  # block-aligned length of the common prefix


class DonorIndex:
    def __init__(
        self,
        block_size: int,
        capacity_bytes: int,
        policy: EvictionPolicy | None = None,
        vectors: "VectorIndex | None" = None,
        clock=time.monotonic,
    ):
        self.block_size = block_size
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self.policy = policy or EvictionPolicy()
        self.vectors = vectors
        self.clock = clock
        self._serials = itertools.count(1)
        self._lru: OrderedDict[DonorKey, DonorRecord] = OrderedDict()
        # namespace -> chain hash -> donors having that block (most recent last)
        self._by_hash: dict[str, dict[bytes, list[DonorKey]]] = {}

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, key: DonorKey) -> bool:
        return key in self._lru

    def get(self, key: DonorKey) -> DonorRecord | None:
        return self._lru.get(key)

    def covers(self, namespace: str, token_ids: Sequence[int]) -> bool:
        """True when a donor of ``namespace`` already holds all of ``token_ids`` as a prefix."""
        hashes = block_hashes(token_ids, self.block_size)
        tail = len(token_ids) - len(hashes) * self.block_size
        table = self._by_hash.get(namespace, {})
        if not hashes or hashes[-1] not in table:
            return False
        if tail == 0:
            return True
        start = len(hashes) * self.block_size
        return any(
            self._lru[k].token_ids[start : start + tail] == list(token_ids[start:])
            for k in table[hashes[-1]]
        )

    def add(self, record: DonorRecord) -> list[DonorKey]:
        """Insert ``record``; returns the keys evicted to make room (oldest first).

        A record larger than the whole capacity is refused (returned as its own eviction).
        """
        if record.key in self._lru:
            self.touch(record.key)
            return []
        if record.nbytes > self.capacity_bytes:
            return [record.key]
        evicted = self._evict_until(self.capacity_bytes - record.nbytes)
        record.serial = next(self._serials)
        record.created = record.last_used = self.clock()
        self._lru[record.key] = record
        self.used_bytes += record.nbytes
        table = self._by_hash.setdefault(record.key.namespace, {})
        for h in record.hashes:
            table.setdefault(h, []).append(record.key)
        return evicted

    def shrink(self, capacity_bytes: int) -> list[DonorKey]:
        """Lower the capacity; returns the keys evicted to fit (oldest first)."""
        self.capacity_bytes = min(self.capacity_bytes, capacity_bytes)
        return self._evict_until(self.capacity_bytes)

    def _evict_until(self, limit: int) -> list[DonorKey]:
        """Evict the policy's victims until at most ``limit`` bytes are used."""
        evicted = []
        while self.used_bytes > limit and self._lru:
            victim = self.policy.victim(self._lru)
            self.remove(victim)
            evicted.append(victim)
        return evicted

    def remove(self, key: DonorKey) -> DonorRecord | None:
        record = self._lru.pop(key, None)
        if record is None:
            return None
        self.used_bytes -= record.nbytes
        table = self._by_hash.get(key.namespace, {})
        for h in record.hashes:
            keys = table.get(h)
            if keys is not None:
                keys.remove(key)
                if not keys:
                    del table[h]
        if not table:
            self._by_hash.pop(key.namespace, None)
        if self.vectors is not None:  # embedded, or offered by its grams alone
            self.vectors.remove(key.namespace, key)
        return record

    def touch(self, key: DonorKey) -> None:
        self._lru.move_to_end(key)
        self._lru[key].last_used = self.clock()

    # ---- discovery and quality ----------------------------------------------------------------
    def offer_content(self, key: DonorKey) -> None:
        """Make the donor findable by its text (sampled 4-grams) now, before its embedding:
        the next turn of a chat may come sooner than the embedding does."""
        record = self._lru.get(key)
        if self.vectors is None or record is None or record.demoted:
            return
        if record.embedding is None:  # (embedded: its grams came with its vector)
            self.vectors.add_grams(key.namespace, key, record.prompt_token_ids)

    def set_embedding(
        self, key: DonorKey, serial: int, embedding: "DocumentEmbedding", fingerprint: int
    ) -> bool:
        """Attach a donor's embedding (computed off-thread for registration ``serial``) and make
        it searchable; False when that registration is gone (evicted, replaced) meanwhile."""
        record = self._lru.get(key)
        if record is None or record.serial != serial:
            return False
        record.embedding, record.fingerprint = embedding, fingerprint
        if self.vectors is not None and not record.demoted:
            self.vectors.add_donor(
                key.namespace, key, embedding.vector, fingerprint, record.prompt_token_ids
            )
        return True

    def demote(self, key: DonorKey) -> None:
        """No longer offered by discovery (an exact prefix still serves; evicted first under
        ``divergence``)."""
        record = self._lru.get(key)
        if record is None:
            return
        record.demoted = True
        if self.vectors is not None:
            self.vectors.remove(key.namespace, key)

    def report_deviation(self, key: DonorKey, deviation: float) -> list[DonorKey]:
        """One measured deviation (0-1) of a reuse of ``key``, from the recompute stage.
        Returns the keys evicted because of it (the donor itself, under ``divergence``)."""
        record = self._lru.get(key)
        if record is None:
            return []
        verdict = self.policy.on_deviation(record, deviation)
        if verdict == "demote" and self.vectors is not None:
            self.vectors.remove(key.namespace, key)  # no longer offered by discovery
        if verdict == "evict":
            self.remove(key)
            return [key]
        return []

    def records(self) -> list[DonorRecord]:
        return list(self._lru.values())

    def longest_prefix(
        self, namespace: str, token_ids: Sequence[int], hashes: Sequence[bytes] | None = None
    ) -> PrefixMatch | None:
        """The donor of ``namespace`` sharing the longest block-aligned prefix with
        ``token_ids``."""
        table = self._by_hash.get(namespace)
        if not table:
            return None
        if hashes is None:
            hashes = block_hashes(token_ids, self.block_size)
        best: DonorKey | None = None
        matched = 0
        for h in hashes:
            keys = table.get(h)
            if not keys:
                break
            best = keys[-1]
            matched += 1
        if best is None:
            return None
        return PrefixMatch(best, matched * self.block_size)
