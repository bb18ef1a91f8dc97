"""Which donor leaves when the store is full (``eviction_policy`` in the config).

The catalog (``donor_index.DonorIndex``) keeps its records in least-recently-used order and asks
the policy for a victim; the KV store, the exact-prefix table and the vector index all drop that
donor together.

* ``lru``: the least recently used donor.
* ``decay`` (LLMCache's staleness decay): value = (1 + hits) * 0.5 ** (idle time / half-life);
  the lowest value leaves, so a donor that was useful long ago gives way to a fresh one.
* ``divergence``: donors whose reuses keep measuring high deviation (reported by the recompute
  stage) are demoted, which takes them out of discovery and puts them first in line; a demoted
  donor that is reported high again is evicted at once. Otherwise LRU.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from semshare_vllm.catalog.donor_index import DonorRecord
    from semshare_vllm.core.keys import DonorKey

# A donor's deviation is judged on this many reports at least (one bad reuse proves little).
MIN_DEVIATION_REPORTS = 3
# Weight of the newest report in the running mean of deviation.
DEVIATION_EMA = 0.5


class EvictionPolicy:
    name = "lru"

    def victim(self, records: "OrderedDict[DonorKey, DonorRecord]") -> "DonorKey":
        """The key to evict next; ``records`` is non-empty, least recently used first."""
        return next(iter(records))

    def on_deviation(self, record: "DonorRecord", deviation: float) -> str:
        """Record one measured deviation of a reuse of ``record``; returns "keep", "demote" or
        "evict"."""
        record.deviation_reports += 1
        record.deviation = (
            deviation
            if record.deviation_reports == 1
            else DEVIATION_EMA * deviation + (1 - DEVIATION_EMA) * record.deviation
        )
        return "keep"


class StalenessDecay(EvictionPolicy):
    name = "decay"

    def __init__(self, half_life_s: float, clock=time.monotonic):
        self.half_life_s = half_life_s
        self.clock = clock

    def value(self, record: "DonorRecord", now: float) -> float:
        return (1 + record.hits) * math.pow(0.5, (now - record.last_used) / self.half_life_s)

    def victim(self, records):
        now = self.clock()
        return min(records.values(), key=lambda r: self.value(r, now)).key  # ties: LRU order


class Divergence(EvictionPolicy):
    name = "divergence"

    def __init__(self, threshold: float):
        self.threshold = threshold

    def victim(self, records):
        for record in records.values():
            if record.demoted:
                return record.key
        return super().victim(records)

    def on_deviation(self, record, deviation):
        super().on_deviation(record, deviation)
        if record.deviation_reports < MIN_DEVIATION_REPORTS or record.deviation <= self.threshold:
            return "keep"
        if record.demoted:
            return "evict"
        record.demoted = True
        return "demote"


def make_policy(
    name: str, *, half_life_s: float = 3600.0, threshold: float = 0.3, clock=time.monotonic
) -> EvictionPolicy:
    if name == "lru":
        return EvictionPolicy()
    if name == "decay":
        return StalenessDecay(half_life_s, clock)
    if name == "divergence":
        return Divergence(threshold)
    raise ValueError(f"unknown eviction policy {name!r}")
