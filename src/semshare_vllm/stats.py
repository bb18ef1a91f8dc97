"""Connector counters, reported through vLLM's KV-connector stats channel.

Both halves count into a ``SemShareStats``; vLLM aggregates the worker's and the scheduler's
per logging interval and prints ``reduce()`` as "KV Transfer metrics: ...". Each half also keeps
running totals (``totals``) that tests and the benchmark read in-process. A half's
``StatsRecorder`` is handed to the components that count from their own threads (discovery, the
shared donor feed), which add to it directly.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

# Every counter, with what it counts. Scheduler-side first, then worker-side.
COUNTERS: dict[str, str] = {
    "lookups": "requests the scheduler looked up",
    "lookup_tokens": "prompt tokens looked up (beyond vLLM's own prefix cache)",
    "hits": "requests served (partly) from a donor",
    "hit_tokens": "prompt tokens claimed from donors",
    "donors_registered": "finished requests accepted as donors",
    "donors_evicted": "donors evicted (capacity) or dropped (found bad)",
    "donors_restored": "donors found again in persist_dir at start-up",
    "persisted_skipped": "persisted donor files skipped as corrupt or foreign",
    "persisted_incomplete": "partial donor files a killed writer left, removed at start-up",
    "fallbacks": "lookups or captures abandoned because of a connector fault",
    "semantic_lookups": "requests whose semantic donor search was started",
    "semantic_found": "searches that found a donor (cosine or SimHash) in the namespace",
    "semantic_misses": "searches that finished and found none",
    "lookups_without_shared_grams": "of those, answered at once: no donor shares enough token "
                                    "4-grams to be aligned (lookup_min_shared_grams)",
    "lookup_timeouts": "searches not finished by lookup_deadline_ms (request went on without)",
    "lookups_skipped": "searches dropped unfinished because the exact prefix covered the prompt",
    "lookup_wait_ms": "milliseconds requests were held back (not scheduled) by their search",
    "donors_embedded": "donors made searchable (embedded off the scheduler thread)",
    "embed_ms": "milliseconds the discovery threads spent embedding (lookups and donors)",
    "discovery_faults": "discovery jobs that failed (the request went on without)",
    "donors_published": "donors announced on the shared index (their KV readable in LMCache's "
                        "remote backend)",
    "donors_shared_in": "donors other instances announced, added to this instance's index",
    "shared_records_dropped": "shared-index records not used (unreadable, id not matching "
                              "their tokens, backlog full)",
    "shared_records_forged": "shared-index records, or the readiness marks of their KV, not "
                             "signed with shared_index_secret (dropped)",
    "shared_records_unready": "shared-index records dropped because their KV never became "
                              "readable (the announcing instance's LMCache put failed)",
    "shared_index_outages": "times the shared index became unreachable (this instance went on "
                            "with its own donors until it was back)",
    "shared_publish_failures": "donor announcements lost to a shared-index outage",
    "semantic_hits": "requests served from a semantic (aligned, not exact-prefix) donor",
    "exact_reused_tokens": "of the semantic hits' claimed tokens, those given the same token's KV",
    "fuzzy_reused_tokens": "of those, given another token's KV (always recomputed)",
    "align_ms": "milliseconds from starting a request's alignment to its result",
    "align_timeouts": "alignments not done by lookup_deadline_ms (request went on without)",
    "loaded_tokens": "tokens written into the paged KV cache from donors",
    "block_copied_tokens": "of those, copied from a donor's own blocks while it was captured",
    "load_failures": "loads that failed (request recomputed those tokens)",
    "captured_tokens": "tokens copied out of the paged KV cache into the host store",
    "captured_donors": "donors captured",
    "load_ms": "milliseconds spent loading donor KV",
    "tier_puts": "donors put in the LMCache tier (kv_tier), readable by other instances",
    "tier_put_failures": "donors the LMCache tier did not take (e.g. its backend unreachable)",
    "tier_put_ms": "milliseconds of tier puts, to readable (off the engine thread)",
    "tier_fetches": "loads whose donor was fetched from the LMCache tier into the host store",
    "tier_fetched_tokens": "tokens of donor KV fetched from the LMCache tier",
    "tier_fetch_ms": "milliseconds spent fetching donor KV from the LMCache tier",
    "tier_digest_mismatches": "another instance's donor KV fetched from the LMCache tier that "
                              "was not what its rank signed (the load failed: recomputed)",
    "capture_ms": "milliseconds spent capturing donor KV",
    "recomputed_tokens": "loaded tokens recomputed through the model (in their first layer)",
    "recomputed_token_layers": "token-layers recomputed (a token recomputed in 3 layers: 3)",
    "recompute_unavailable_tokens": "loaded tokens needing repair with no layer runner here "
                                    "(reported failed: vLLM computed them)",
    "recompute_failures": "recomputes that failed (vLLM computed those tokens instead)",
    "recompute_ms": "milliseconds spent recomputing loaded tokens",
    "deviation_sum": "sum of measured deviations of repaired semantic loads (mean relative K/V "
                     "deviation of the loaded tokens at the policy's check layer)",
    "deviation_count": "repaired semantic loads whose deviation was measured",
    "reuse_opt_outs": "requests whose kv_transfer_params turned reuse off or down to exact",
    "reuse_forced": "requests whose kv_transfer_params asked for a semantic donor regardless",
    "unkeyable_requests": "requests never served nor captured: their token ids do not say what "
                          "their KV is (prompt embeddings)",
    "failed_blocks_uncached": "blocks of failed loads (and those computed after them) taken out "
                              "of vLLM's prefix cache",
}


@dataclass
class SemShareStats(KVConnectorStats):
    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {name: 0 for name in COUNTERS}

    def add(self, name: str, value: float = 1) -> None:
        self.data[name] = self.data.get(name, 0) + value

    def aggregate(self, other: KVConnectorStats) -> "SemShareStats":
        for name, value in other.data.items():
            self.add(name, value)
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {k: round(v, 2) if isinstance(v, float) else v
                                       for k, v in self.data.items() if v}
        if self.data.get("lookup_tokens"):
            out["hit_token_rate"] = round(self.data["hit_tokens"] / self.data["lookup_tokens"], 3)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


class StatsRecorder:
    """One half's counters: an interval ``SemShareStats`` handed to vLLM, plus running totals.
    Thread-safe: components add from their own threads while the engine thread takes."""

    def __init__(self) -> None:
        self.totals: Counter[str] = Counter()
        self._interval = SemShareStats()
        self._lock = threading.Lock()

    def add(self, name: str, value: float = 1) -> None:
        if name not in COUNTERS:
            raise KeyError(name)
        with self._lock:
            self.totals[name] += value
            self._interval.add(name, value)

    def take(self) -> SemShareStats | None:
        """The interval's stats (None when nothing happened); starts a new interval."""
        with self._lock:
            if self._interval.is_empty():
                return None
            out, self._interval = self._interval, SemShareStats()
        return out


class SemSharePromMetrics(KVConnectorPromMetrics):
    """Every counter as a Prometheus counter ``vllm:semshare_<name>`` (``_total`` appended by
    the client), per engine, fed from the aggregated stats vLLM's frontend receives."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        from vllm.v1.metrics.utils import create_metric_per_engine

        self._counters = {
            name: create_metric_per_engine(
                self._counter_cls(name=f"vllm:semshare_{name}", documentation=doc,
                                  labelnames=labelnames), per_engine_labelvalues)
            for name, doc in COUNTERS.items()}

    def observe(self, transfer_stats_data: dict, engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            per_engine = self._counters.get(name)
            if per_engine is not None and value and value > 0:
                per_engine[engine_idx].inc(value)
