"""The scheduler's catalog of donors: what exists, in which namespace, and which prefix it shares.

The catalog is authoritative for what the host store holds: it does the byte accounting and picks
LRU victims, and the worker drops what it is told to. Namespaces are separate dictionaries, so a
lookup in one namespace cannot see another's donors; the empty namespace is a namespace like any.

Exact-prefix matching uses a chain hash per block of ``block_size`` tokens: the hash of block i
covers tokens [0, (i+1) * block_size), so the longest run of equal hashes is the longest
block-aligned common prefix.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from semshare_vllm.metadata import DonorKey


def donor_id_for(namespace: str, token_ids: Sequence[int]) -> str:
    h = hashlib.blake2b(digest_size=16)
    h.update(namespace.encode())
    h.update(b"\0")
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.hexdigest()


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """Chain hashes of each full block of ``token_ids``."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    out: list[bytes] = []
    prev = b""
    for i in range(len(tokens) // block_size):
        prev = hashlib.blake2b(prev + tokens[i * block_size:(i + 1) * block_size].tobytes(),
                               digest_size=16).digest()
        out.append(prev)
    return out


@dataclass
class DonorRecord:
    key: DonorKey
    token_ids: list[int]
    nbytes: int
    hashes: list[bytes] = field(repr=False)
    hits: int = 0


@dataclass(frozen=True)
class PrefixMatch:
    key: DonorKey
    num_tokens: int  # block-aligned length of the common prefix


class DonorIndex:
    def __init__(self, block_size: int, capacity_bytes: int):
        self.block_size = block_size
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
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
        return any(self._lru[k].token_ids[start:start + tail] == list(token_ids[start:])
                   for k in table[hashes[-1]])

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
        """Evict least recently used donors until at most ``limit`` bytes are used."""
        evicted = []
        while self.used_bytes > limit and self._lru:
            victim = next(iter(self._lru))
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
        return record

    def touch(self, key: DonorKey) -> None:
        self._lru.move_to_end(key)

    def longest_prefix(self, namespace: str, token_ids: Sequence[int],
                       hashes: Sequence[bytes] | None = None) -> PrefixMatch | None:
        """The donor of ``namespace`` sharing the longest block-aligned prefix with ``token_ids``."""
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
