"""Tensor parallelism, with two real ranks: two processes in vLLM's own tensor-parallel group
(gloo on CPU), each a worker half whose recompute drives a stand-in model with a row-parallel
``o_proj`` (``support/tp_ranks.py``). Each rank holds other KV heads and other donor KV, so each
measures other scores.

* Both ranks recompute the same positions, as many in every layer (the scores are summed over
  the ranks before the policy chooses); without that, CacheBlend's ranks sum different tokens
  and SemShareKV's keep different counts.
* A load or repair that fails on one rank fails on both: the same blocks are reported on each,
  and neither waits in a collective the other skipped (a hang is caught by a timeout).
"""

import pytest
from support.tp_pair import TPPair
from support.tp_ranks import TARGET_BLOCKS


@pytest.fixture(scope="module")
def pair():
    p = TPPair()
    yield p
    p.close()


def test_the_collectives_agree_over_vllms_tensor_parallel_group(pair):
    r0, r1 = pair.run("collectives")
    assert (r0["rank"], r1["rank"]) == (0, 1)
    assert r0["one_says_no"] is r1["one_says_no"] is False
    assert r0["all_say_yes"] is r1["all_say_yes"] is True
    assert r0["scores"] == r1["scores"] == [3.0, 2.0]


@pytest.mark.parametrize("policy", ["cacheblend", "semsharekv", "adaptive"])
def test_both_ranks_recompute_the_same_positions(pair, policy):
    r0, r1 = pair.run(policy)
    assert "error" not in r0 and "error" not in r1, (r0, r1)
    assert r0["invalid"] == r1["invalid"] == []  # repaired, on both
    (a,), (b,) = r0["recomputes"], r1["recomputes"]
    assert a["per_layer"] == b["per_layer"]
    assert a["positions"] == b["positions"]
    if policy == "adaptive":  # escalated to every position: layer 0 twice for all
        assert a["per_layer"][0] == 2 * len(a["positions"])
        assert r0["stats"]["recompute_escalations"] == r1["stats"]["recompute_escalations"] > 0
    else:
        assert 0 < len(a["positions"]) < a["per_layer"][0]  # the policy did choose


def test_both_ranks_decline_alike(pair):
    """The adaptive gate declines the load on both ranks (the same summed scores): both report
    its blocks, neither counts it as the other's failure."""
    r0, r1 = pair.run("adaptive_declined")
    assert "error" not in r0 and "error" not in r1, (r0, r1)
    assert r0["invalid"] == r1["invalid"] == TARGET_BLOCKS
    for r in (r0, r1):
        assert r["stats"]["recompute_declined"] == 1 and "tp_peer_failures" not in r["stats"]


@pytest.mark.parametrize("scenario", ["exact_load_lost_on_rank0", "repaired_load_lost_on_rank0"])
def test_a_load_that_failed_on_one_rank_fails_on_both(pair, scenario):
    r0, r1 = pair.run(scenario)
    assert r0["stats"]["load_failures"] == 1 and "load_failures" not in r1["stats"]
    assert r0["invalid"] == r1["invalid"] == TARGET_BLOCKS
    assert r0["recomputes"] == r1["recomputes"] == []  # no repair started, on either


@pytest.mark.parametrize("scenario", ["selection_fails_on_rank0", "attention_fails_on_rank0"])
def test_a_repair_that_failed_on_one_rank_fails_on_both(pair, scenario):
    r0, r1 = pair.run(scenario)
    assert r0["stats"].get("recompute_failures") == 1
    assert "recompute_failures" not in r1["stats"]
    assert r0["invalid"] == r1["invalid"] == TARGET_BLOCKS


def test_a_semantic_load_moved_beside_layer_0_is_repaired_alike(pair):
    """On CPU the move runs beside layer 0 and the ranks agree on it before layer 1 (three
    agreements): both repair, the same positions."""
    r0, r1 = pair.run("semantic")
    assert "error" not in r0 and "error" not in r1, (r0, r1)
    assert r0["invalid"] == r1["invalid"] == []
    (a,), (b,) = r0["recomputes"], r1["recomputes"]
    assert a == b and 0 < len(a["positions"]) < a["per_layer"][0]


def test_a_move_that_failed_on_one_rank_stops_both_before_layer_1(pair):
    r0, r1 = pair.run("semantic_move_fails_on_rank0")
    assert "error" not in r0 and "error" not in r1, (r0, r1)
    assert r0["invalid"] == r1["invalid"] == TARGET_BLOCKS
    assert r0["stats"]["load_failures"] == 1 and "load_failures" not in r1["stats"]
    assert r1["stats"]["tp_peer_failures"] == 1 and "tp_peer_failures" not in r0["stats"]
    (a,), (b,) = r0["recomputes"], r1["recomputes"]
    assert a["per_layer"][1:] == b["per_layer"][1:] == [0]  # layer 0 only, on both
