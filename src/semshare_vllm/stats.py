"""The connector's counters (``core/counters.py``) in vLLM's KV-connector stats channel.

Each half counts into its ``StatsRecorder``; the connector hands vLLM the interval's counts as a
``SemShareStats``, which vLLM aggregates over the worker and the scheduler per logging interval
and prints (``reduce()``) as "KV Transfer metrics: ...", and exports to Prometheus
(``SemSharePromMetrics``).
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from semshare_vllm.core.counters import COUNTERS


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
        out: dict[str, int | float] = {
            k: round(v, 2) if isinstance(v, float) else v for k, v in self.data.items() if v
        }
        if self.data.get("lookup_tokens"):
            out["hit_token_rate"] = round(self.data["hit_tokens"] / self.data["lookup_tokens"], 3)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())

    @classmethod
    def of(cls, counts: dict[str, float] | None) -> "SemShareStats | None":
        """An interval's counts (``StatsRecorder.take``) as vLLM's stats object."""
        if not counts:
            return None
        stats = cls()
        for name, value in counts.items():
            stats.add(name, value)
        return stats


class SemSharePromMetrics(KVConnectorPromMetrics):
    """Every counter as a Prometheus counter ``vllm:semshare_<name>`` (``_total`` appended by
    the client), per engine, fed from the aggregated stats vLLM's frontend receives."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        from vllm.v1.metrics.utils import create_metric_per_engine

        self._counters = {
            name: create_metric_per_engine(
                self._counter_cls(
                    name=f"vllm:semshare_{name}", documentation=doc, labelnames=labelnames
                ),
                per_engine_labelvalues,
            )
            for name, doc in COUNTERS.items()
        }

    def observe(self, transfer_stats_data: dict, engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            per_engine = self._counters.get(name)
            if per_engine is not None and value and value > 0:
                per_engine[engine_idx].inc(value)
