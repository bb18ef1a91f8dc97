"""The connector's counters and histograms in vLLM's stats channel (``stats.py``): the interval
a recorder hands over, aggregated as vLLM aggregates it (worker with scheduler, interval after
interval), logged, and exported to Prometheus."""

import functools
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from semshare_vllm.core.counters import HISTOGRAMS, LAYER_HISTOGRAMS, StatsRecorder
from semshare_vllm.stats import SemSharePromMetrics, SemShareStats


def test_observations_travel_as_lists_and_merge_without_touching_each_other():
    rec = StatsRecorder()
    rec.add("hits")
    rec.observe("served_recompute_share", 0.25)
    rec.observe("served_recompute_share", 0.0)
    payload = rec.take()
    assert payload == {"hits": 1, "served_recompute_share": [0.25, 0.0]}
    assert rec.take() is None  # a new interval
    assert rec.observed == {"served_recompute_share": [0.25, 0.0]}  # the running record

    worker = SemShareStats.of({"recomputed_tokens": 10})
    scheduler = SemShareStats.of(payload)
    merged = worker.aggregate(scheduler)  # as Scheduler.update_from_output does
    # as vLLM's frontend does: the logging accumulator and Prometheus read one payload
    logged = SemShareStats(data=dict(merged.data))
    logged.aggregate(SemShareStats.of({"served_recompute_share": [1.0]}))
    assert merged.data["served_recompute_share"] == [0.25, 0.0]  # untouched by the logger's
    assert logged.data["served_recompute_share"] == [0.25, 0.0, 1.0]
    reduced = logged.reduce()
    assert reduced["served_recompute_share_count"] == 3
    assert reduced["served_recompute_share_mean"] == round(1.25 / 3, 3)
    assert reduced["hits"] == 1 and not SemShareStats().aggregate(merged).is_empty()


def test_histograms_reach_prometheus():
    registry = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    vllm_config = SimpleNamespace(kv_transfer_config=None)
    prom = SemSharePromMetrics(vllm_config, types, ["engine"], {0: ["0"]})
    prom.observe({"hits": 2, "served_deviation_before": [0.3, 0.04], "served_recompute_share": []})
    sample = functools.partial(registry.get_sample_value, labels={"engine": "0"})
    assert sample("vllm:semshare_hits_total") == 2
    assert sample("vllm:semshare_served_deviation_before_count") == 2
    assert sample("vllm:semshare_served_deviation_before_sum") == pytest.approx(0.34)
    assert (
        registry.get_sample_value(
            "vllm:semshare_served_deviation_before_bucket", {"engine": "0", "le": "0.05"}
        )
        == 1
    )
    assert sample("vllm:semshare_served_recompute_share_count") == 0
    assert set(HISTOGRAMS) == {
        "served_recompute_share",
        "served_deviation_before",
        "served_deviation_after",
        "served_gate_residual",
        "served_search_ms",
        "served_align_ms",
        "served_load_ms",
        "served_recompute_ms",
        "served_recompute_whole_ms",
        "missed_search_ms",
        "missed_align_ms",
        "declined_search_ms",
        "declined_align_ms",
        "declined_load_ms",
        "declined_recompute_ms",
    }


def test_a_hits_recompute_by_layer_reaches_prometheus_labelled_by_layer():
    rec = StatsRecorder()
    rec.observe_layers("served_recompute_layer_ms", [300, 50, 4])
    rec.observe_layers("served_recompute_layer_ms", [200, 40, 6])
    payload = rec.take()
    assert payload == {"served_recompute_layer_ms": [[300.0, 50.0, 4.0], [200.0, 40.0, 6.0]]}
    assert rec.observed["served_recompute_layer_ms"] == payload["served_recompute_layer_ms"]
    with pytest.raises(KeyError):
        rec.observe_layers("served_recompute_ms", [1.0])  # not a per-layer histogram
    merged = SemShareStats.of(payload).aggregate(
        SemShareStats.of({"served_recompute_layer_ms": [[100.0, 30.0, 2.0]]})
    )
    assert merged.reduce() == {"served_recompute_layer_ms_count": 3}  # hits, not layers

    registry = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    vllm_config = SimpleNamespace(kv_transfer_config=None)
    prom = SemSharePromMetrics(vllm_config, types, ["engine"], {0: ["0"], 1: ["1"]})
    prom.observe(merged.data, engine_idx=1)

    def sample(suffix, layer, engine="1"):
        return registry.get_sample_value(
            f"vllm:semshare_served_recompute_layer_ms_{suffix}",
            {"engine": engine, "layer": str(layer)},
        )

    assert [sample("count", i) for i in range(3)] == [3, 3, 3]
    assert [sample("sum", i) for i in range(3)] == [600, 120, 12]
    assert sample("count", 0, engine="0") is None  # nothing observed for engine 0
    assert set(LAYER_HISTOGRAMS) == {"served_recompute_layer_ms"}


def test_the_running_record_keeps_the_latest_observations_only(monkeypatch):
    monkeypatch.setattr(StatsRecorder, "KEEP_OBSERVED", 3)
    rec = StatsRecorder()
    for i in range(10):
        rec.observe("served_recompute_ms", i)
        rec.observe_layers("served_recompute_layer_ms", [i, i])
    assert 3 <= len(rec.observed["served_recompute_ms"]) <= 6
    assert rec.observed["served_recompute_ms"][-3:] == [7.0, 8.0, 9.0]
    assert rec.observed["served_recompute_layer_ms"][-1] == [9.0, 9.0]
    # the interval's observations are all handed over, whatever the record keeps
    assert len(rec.take()["served_recompute_ms"]) == 10
