"""The connector's counters and histograms (``core/counters.py``) in vLLM's KV-connector stats
channel.

Each half counts into its ``StatsRecorder``; the connector hands vLLM the interval's counts as a
``SemShareStats``, which vLLM aggregates over the worker and the scheduler per logging interval
and prints (``reduce()``) as "KV Transfer metrics: ...", and exports to Prometheus
(``SemSharePromMetrics``). A histogram travels as the list of its observations (serialisable,
like NIXL's transfer durations), and lists are merged by concatenation.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from semshare_vllm.core.counters import COUNTERS, HISTOGRAMS, LAYER_HISTOGRAMS


@dataclass
class SemShareStats(KVConnectorStats):
    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {name: 0 for name in COUNTERS}

    def add(self, name: str, value: float | list[float] = 1) -> None:
        old = self.data.get(name)
        if isinstance(value, list):
            # A new list, never extended in place: vLLM hands one payload to both its logging
            # accumulator and Prometheus, which must not see each other's observations.
            self.data[name] = (old if isinstance(old, list) else []) + value
        else:
            self.data[name] = (old or 0) + value

    def aggregate(self, other: KVConnectorStats) -> "SemShareStats":
        for name, value in other.data.items():
            self.add(name, value)
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for name, value in self.data.items():
            if isinstance(value, list):  # a histogram: how many, and their mean
                if value and name in LAYER_HISTOGRAMS:  # one vector per observation
                    out[f"{name}_count"] = len(value)
                elif value:
                    out[f"{name}_count"] = len(value)
                    out[f"{name}_mean"] = round(sum(value) / len(value), 3)
            elif value:
                out[name] = round(value, 2) if isinstance(value, float) else value
        if self.data.get("lookup_tokens"):
            out["hit_token_rate"] = round(self.data["hit_tokens"] / self.data["lookup_tokens"], 3)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())

    @classmethod
    def of(cls, counts: dict[str, float | list[float]] | None) -> "SemShareStats | None":
        """An interval's counts (``StatsRecorder.take``) as vLLM's stats object."""
        if not counts:
            return None
        stats = cls()
        for name, value in counts.items():
            stats.add(name, value)
        return stats


class SemSharePromMetrics(KVConnectorPromMetrics):
    """Every counter as a Prometheus counter ``vllm:semshare_<name>`` (``_total`` appended by
    the client), every histogram as a histogram of the same name, per engine (a per-layer one
    also per ``layer``), fed from the aggregated stats vLLM's frontend receives."""

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
        self._histograms = {
            name: create_metric_per_engine(
                self._histogram_cls(
                    name=f"vllm:semshare_{name}",
                    documentation=doc,
                    buckets=list(buckets),
                    labelnames=labelnames,
                ),
                per_engine_labelvalues,
            )
            for name, (doc, buckets) in HISTOGRAMS.items()
        }
        # per layer: a child per (engine, layer), made on first use
        self._engine_labels = per_engine_labelvalues
        self._layer_histograms = {
            name: self._histogram_cls(
                name=f"vllm:semshare_{name}",
                documentation=doc,
                buckets=list(buckets),
                labelnames=[*labelnames, "layer"],
            )
            for name, (doc, buckets) in LAYER_HISTOGRAMS.items()
        }

    def observe(self, transfer_stats_data: dict, engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            if isinstance(value, list) and name in self._layer_histograms:
                metric, labels = self._layer_histograms[name], self._engine_labels[engine_idx]
                for vector in value:
                    for layer, ms in enumerate(vector):
                        metric.labels(*labels, str(layer)).observe(ms)
                continue
            if isinstance(value, list):
                per_engine = self._histograms.get(name)
                for v in value if per_engine is not None else ():
                    per_engine[engine_idx].observe(v)
                continue
            per_engine = self._counters.get(name)
            if per_engine is not None and value and value > 0:
                per_engine[engine_idx].inc(value)
