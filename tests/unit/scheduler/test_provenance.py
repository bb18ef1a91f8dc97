"""Per-request provenance from the scheduler half, with hand-built requests (no engine): what
``request_finished`` returns for a miss, an exact hit and a repaired load; the worker's figures
written into a dict vLLM still holds (the request finished in the output that carries them),
never after that output is settled, never from another load; the donor reference; and the
histograms observed from the same figures."""

from dataclasses import replace
from types import SimpleNamespace

from support.scheduler import Blocks, finish, geometry, request

from semshare_vllm.config import SemShareConfig
from semshare_vllm.core.keys import DonorKey
from semshare_vllm.metadata import RepairReport, SemShareWorkerMetadata
from semshare_vllm.scheduler import SemShareScheduler
from semshare_vllm.scheduler.provenance import KEY, Provenance

DONOR = list(range(200))


def scheduler(**config):
    s = SemShareScheduler(SemShareConfig(**config), geometry())
    assert finish(s, DONOR)[0] is True  # captured: a donor of 201 tokens
    s.build_connector_meta(None)
    s.update_connector_output(output(finished_sending={"done"}))
    assert s.stats.observed.pop("missed_search_ms") == [0.0]  # the donor was a miss itself
    assert s.stats.observed.pop("missed_align_ms") == [0.0]
    return s


def output(repairs=(), invalid=None, finished_sending=None):
    """The worker's ``KVConnectorOutput`` for one step, as vLLM hands it to the connector."""
    return SimpleNamespace(
        finished_sending=finished_sending,
        invalid_block_ids=invalid,
        kv_connector_worker_meta=SemShareWorkerMetadata(repairs=list(repairs)),
    )


def admit(s, req_id, tokens, computed=0):
    """vLLM asks, then allocates for the claim; the worker's ``LoadSpec`` (None: no claim)."""
    r = request(req_id, tokens)
    claim, _ = s.get_num_new_matched_tokens(r, computed)
    s.update_state_after_alloc(r, Blocks(list(range(10, 17))), claim)
    loads = s.build_connector_meta(None).loads
    return r, (loads[0] if loads else None)


def end(s, r):
    r.num_computed_tokens = r.num_tokens - 1
    return s.request_finished(r, list(range(10, 17)))


def test_a_miss_and_an_exact_hit():
    s = scheduler()
    miss, load = admit(s, "m", list(range(1000, 1100)))
    assert load is None
    s.requests["m"].search_wait_ms = 37.46  # held back for a search that found nothing
    delay, params = end(s, miss)
    assert delay is True  # a new donor: vLLM keeps its blocks, as before
    assert params == {
        KEY: {
            "version": 1,
            "served": "none",
            "prompt_tokens": 100,
            "vllm_cached_tokens": 0,
            "exact_tokens": 0,
            "semantic_tokens": 0,
            "donor": None,
            "recompute_policy": "none",
            "recompute_share": None,
            "deviation_before": None,
            "deviation_after": None,
            "gate_residual": None,
            "repair_report": None,
            "load_failed": False,
            "preemptions": 0,
            "escalations": 0,
            "declined": False,
            # nothing loaded
            "timings_ms": {"search": 37.5, "align": 0.0, "load": None, "recompute": None},
            "recompute_layers_ms": None,
            "recompute_whole_ms": None,
        }
    }
    hit, load = admit(s, "h", DONOR[:150] + [1, 2, 3], computed=64)  # vLLM's own hit: 64
    got = end(s, hit)[1][KEY]
    assert (got["served"], got["exact_tokens"], got["vllm_cached_tokens"]) == ("exact", 64, 64)
    assert got["recompute_share"] == 0.0 and got["repair_report"] is None  # exact KV as is
    s.take_stats()
    # a miss's waits are observed apart from the hits' (what a miss cost: issue 21 asks it be
    # nothing); an exact hit reports no worker time (only repairs do)
    assert s.stats.observed == {
        "missed_search_ms": [37.5],
        "missed_align_ms": [0.0],
        "served_recompute_share": [0.0],
        "served_search_ms": [0.0],
        "served_align_ms": [0.0],
    }


def test_the_donor_reference_names_the_donor_only_within_its_identity():
    s = scheduler()
    refs = [end(s, admit(s, f"t{i}", DONOR[:150] + [i])[0])[1][KEY]["donor"] for i in range(2)]
    assert refs[0] == refs[1]  # the same donor, the same name while the process lives
    assert all(c in "0123456789abcdef" for c in refs[0]) and len(refs[0]) == 32
    key = DonorKey("", s.index.longest_prefix("", DONOR).key.donor_id)
    assert key.donor_id not in refs[0]
    # another process: another secret, another name for the same donor
    assert Provenance(s.stats)._reference(key) != refs[0]
    # the same tokens in another identity (tenant) are another donor, with an unrelated name
    other = DonorKey("tenant-b", key.donor_id)
    assert Provenance(s.stats)._reference(other) != Provenance(s.stats)._reference(key)
    # instances sharing donors (shared_index_secret) name them alike
    a, b = Provenance(s.stats, "secret"), Provenance(s.stats, "secret")
    assert a._reference(key) == b._reference(key) != Provenance(s.stats, "other")._reference(key)


def test_figures_reported_in_the_finishing_output_are_written_into_the_dict_vllm_holds():
    s = scheduler(recompute_policy="all")  # exact loads repaired: the worker reports figures
    r, load = admit(s, "t", DONOR[:150] + [1])
    assert load.policy == "all" and load.seq > 0
    # vLLM finishes the request in its update_from_output loop, then hands us the step's report
    delay, params = end(s, r)
    assert delay is False  # no donor: its prompt is the donor's, which covers it
    assert params[KEY]["repair_report"] == "missing"
    sent = params[KEY]
    figures = RepairReport(
        "t",
        load.seq,
        1.0,
        0.3,
        0.1,
        0.0151,  # the gate's estimate
        load_ms=12.34,
        recompute_ms=456.78,
        recompute_layer_ms=[300.04, 156.74],
        recompute_whole_ms=300.04,
    )
    s.update_connector_output(output([figures]))
    got = params[KEY]  # the same outer dict vLLM put in the EngineCoreOutput
    assert got["repair_report"] == "received" and got["recompute_share"] == 1.0
    assert (got["deviation_before"], got["deviation_after"]) == (0.3, 0.1)
    assert got["gate_residual"] == 0.0151
    # the hit's time breakdown: the worker's part comes with its figures
    assert sent["timings_ms"] == {"search": 0.0, "align": 0.0, "load": None, "recompute": None}
    assert got["timings_ms"] == {"search": 0.0, "align": 0.0, "load": 12.3, "recompute": 456.8}
    assert (sent["recompute_layers_ms"], sent["recompute_whole_ms"]) == (None, None)
    assert (got["recompute_layers_ms"], got["recompute_whole_ms"]) == ([300.0, 156.7], 300.0)
    assert {k: v for k, v in got.items() if v != sent[k]}.keys() == {
        "recompute_share",
        "deviation_before",
        "deviation_after",
        "gate_residual",
        "repair_report",
        "timings_ms",
        "recompute_layers_ms",
        "recompute_whole_ms",
    }
    s.take_stats()  # vLLM asks for stats at the end of update_from_output: settled
    assert s.stats.observed == {
        "served_recompute_share": [1.0],
        "served_deviation_before": [0.3],
        "served_deviation_after": [0.1],
        "served_gate_residual": [0.0151],
        "served_search_ms": [0.0],
        "served_align_ms": [0.0],
        "served_load_ms": [12.3],
        "served_recompute_ms": [456.8],
        "served_recompute_whole_ms": [300.0],
        "served_recompute_layer_ms": [[300.0, 156.7]],
    }
    # a report for it now (there is none: a duplicate) writes nothing
    s.update_connector_output(output([RepairReport("t", load.seq, 0.5)]))
    assert params[KEY] == got


def test_figures_not_in_the_finishing_output_stay_unknown():
    s = scheduler(recompute_policy="all")
    r, load = admit(s, "t", DONOR[:150] + [1])
    params = end(s, r)[1]
    s.update_connector_output(output())  # this output carries no report of it
    s.take_stats()
    s.update_connector_output(output([RepairReport("t", load.seq, 1.0)]))  # too late
    got = params[KEY]
    assert got["repair_report"] == "missing" and got["recompute_share"] is None
    assert "served_recompute_share" not in s.stats.observed
    # the next schedule settles too (a backstop, should vLLM not ask for stats)
    r2, load2 = admit(s, "u", DONOR[:150] + [2])
    params2 = end(s, r2)[1]
    s.build_connector_meta(None)
    s.update_connector_output(output([RepairReport("u", load2.seq, 1.0)]))
    assert params2[KEY]["repair_report"] == "missing"


def test_a_live_request_keeps_its_own_loads_figures_only():
    s = scheduler(recompute_policy="all")
    r, load = admit(s, "t", DONOR[:150] + [1])
    # another load's figures (an earlier admission's, another request's) are not its own
    s.update_connector_output(
        output([RepairReport("t", load.seq - 1, 0.5), RepairReport("x", load.seq, 0.5)])
    )
    assert s.requests["t"].served.repair is None
    s.update_connector_output(output([RepairReport("t", load.seq, 1.0)]))
    got = end(s, r)[1][KEY]  # decoded for a few steps, then finished
    assert got["repair_report"] == "received" and got["recompute_share"] == 1.0
    assert s.stats.observed["served_recompute_share"] == [1.0]


def test_a_failed_load_reports_no_figures_and_a_readmission_starts_afresh():
    s = scheduler(recompute_policy="all")
    r, load = admit(s, "t", DONOR[:150] + [1])
    s.update_connector_output(output(invalid=set(load.block_ids)))  # vLLM recomputes them
    got = end(s, r)[1][KEY]
    assert got["served"] == "exact" and got["load_failed"] is True
    assert got["recompute_share"] is None and got["repair_report"] is None
    s.take_stats()
    assert not s.stats.observed

    # preempted after its load: admitted again with nothing to claim, it reports that
    r, load = admit(s, "p", DONOR[:150] + [2])
    r.num_preemptions = 1
    s.get_num_new_matched_tokens(r, 128)  # vLLM's own cache holds the prefix now
    s.update_state_after_alloc(r, Blocks(list(range(20, 27))), 0)
    got = end(s, r)[1][KEY]
    assert (got["served"], got["vllm_cached_tokens"], got["preemptions"]) == ("none", 128, 1)


def test_a_fault_building_the_provenance_never_costs_the_capture(monkeypatch):
    s = scheduler()
    monkeypatch.setattr(s.provenance, "finished", lambda *a: 1 / 0)
    r, _ = admit(s, "m", list(range(1000, 1100)))
    assert end(s, r) == (True, None)
    assert s.stats.totals["fallbacks"] == 1


def test_escalations_are_reported_and_a_donor_that_keeps_needing_them_is_demoted():
    """The gate's figures reach the provenance; loads into two prompts from one donor that the
    gate had to widen demote it (no longer offered by discovery)."""
    s = scheduler(recompute_policy="all")
    s.config = replace(s.config, capture=False)  # every load from DONOR, none from a request
    key = None
    for i in range(2):
        r, load = admit(s, f"t{i}", DONOR[:150] + [i])
        key = load.key
        assert not s.index.get(key).demoted
        s.update_connector_output(
            output([RepairReport(f"t{i}", load.seq, 0.6, 0.1, 0.01, 0.03, escalations=1)])
        )
        got = end(s, r)[1][KEY]
        assert got["escalations"] == 1 and got["gate_residual"] == 0.03
    assert s.index.get(key).demoted and s.index.get(key).escalations == 2
    assert s.stats.totals["donors_demoted_by_escalation"] == 1
    # figures that match no load demote nothing
    other = scheduler(recompute_policy="all")
    for _ in range(3):
        other.update_connector_output(output([RepairReport("nobody", 1, 1.0, escalations=2)]))
    assert "donors_demoted_by_escalation" not in other.stats.totals


def test_a_declined_loads_time_is_observed_apart_from_the_hits():
    """A load the gate declined is reported failed and vLLM computes the prompt: it is no hit,
    so none of the ``served_*`` histograms sees it, but what trying cost (held back for the
    search and the alignment, the move, the recompute up to the decline) is observed in the
    ``declined_*_ms`` histograms, from the same figures its provenance returns."""
    s = scheduler(recompute_policy="all")
    r, load = admit(s, "t", DONOR[:150] + [1])
    figures = RepairReport(
        "t", load.seq, 0.4, 0.05, 0.01, 0.03, escalations=1, declined=True,
        load_ms=12.34, recompute_ms=456.78, recompute_layer_ms=[300.0, 156.78],
        recompute_whole_ms=300.0,
    )  # fmt: skip
    s.update_connector_output(output([figures], invalid=set(load.block_ids)))
    got = end(s, r)[1][KEY]
    assert got["declined"] is True and got["load_failed"] is True
    assert got["gate_residual"] == 0.03 and got["escalations"] == 1
    assert got["timings_ms"] == {"search": 0.0, "align": 0.0, "load": 12.3, "recompute": 456.8}
    s.take_stats()
    assert s.stats.observed == {
        "declined_search_ms": [0.0],
        "declined_align_ms": [0.0],
        "declined_load_ms": [12.3],
        "declined_recompute_ms": [456.8],
    }
