"""A donor whose load into a prompt needed more than its repair (the gate escalated, or declined
the load) is withheld from that prompt, and demoted once two prompts needed it: the worker's
figures through the scheduler half into the donor's record, with hand-built requests (no
engine). Every load here is exact under ``recompute_policy`` "all", only to carry hand-made
figures; that a withheld donor is not offered again on the semantic path is tested through vLLM's
real scheduler (tests/unit/vllm_scheduler/test_vllm_scheduler_semantic.py)."""

from dataclasses import replace
from types import SimpleNamespace

import pytest
from support.scheduler import Blocks, finish, geometry, request

from semshare_vllm.config import SemShareConfig
from semshare_vllm.metadata import RepairReport, SemShareWorkerMetadata
from semshare_vllm.scheduler import SemShareScheduler
from semshare_vllm.scheduler.request_state import RequestState

DONOR = list(range(200))
PROMPT = DONOR[:150] + [5]


@pytest.fixture
def s():
    """A scheduler whose only donor is DONOR: every load below comes from it."""
    s = SemShareScheduler(SemShareConfig(recompute_policy="all"), geometry())
    assert finish(s, DONOR)[0] is True
    s.build_connector_meta(None)
    s.update_connector_output(report(finished_sending={"done"}))
    s.config = replace(s.config, capture=False)  # no request becomes a donor
    return s


def report(repairs=(), finished_sending=None):
    return SimpleNamespace(
        finished_sending=finished_sending,
        invalid_block_ids=None,
        kv_connector_worker_meta=SemShareWorkerMetadata(repairs=list(repairs)),
    )


def load(s, r):
    claim, _ = s.get_num_new_matched_tokens(r, 0)
    s.update_state_after_alloc(r, Blocks(list(range(10, 17))), claim)
    (spec,) = s.build_connector_meta(None).loads
    return spec


def repaired(s, r, spec, **figures):
    """The worker's figures of ``r``'s load (``figures``: the gate's), then ``r`` finishes."""
    s.update_connector_output(
        report([RepairReport(r.request_id, spec.seq, 0.6, 0.1, 0.01, 0.03, **figures)])
    )
    r.num_computed_tokens = r.num_tokens - 1
    s.request_finished(r, list(range(10, 17)))


def digest(r) -> int:
    return RequestState(r.request_id).served_prompt(r).digest


@pytest.mark.parametrize(
    "figures",
    [{"escalations": 1}, {"escalations": 1, "declined": True}, {"declined": True}],
    ids=["escalated", "declined-at-the-gate", "declined-at-the-check-layer"],
)
def test_a_prompt_that_needed_more_than_the_repair_is_withheld_the_donor(s, figures):
    """Sent again, its load would escalate (or be declined) again: the donor is withheld from
    that prompt only, and demoted once a second prompt needed more. A request scoring the
    prompt's continuation measures what served it: the donor where the load escalated, vLLM's
    own computation where it was declined (seen in semshare-bench: a declined target's scoring
    request loaded the donor and was declined again). Before, a check layer's decline (no
    escalation) counted for nothing."""
    r = request("t0", PROMPT)
    spec = load(s, r)
    repaired(s, r, spec, **figures)
    record = s.index.get(spec.key)
    assert record.withheld(digest(r), scoring=False)
    assert record.withheld(digest(r), scoring=True) == figures.get("declined", False)
    assert not record.withheld(digest(request("o", DONOR[:150] + [6])), scoring=False)
    assert not record.demoted and s.stats.totals["prompts_withheld_a_donor"] == 1

    other = request("o", DONOR[:150] + [6])
    repaired(s, other, load(s, other), **figures)
    assert record.demoted and s.stats.totals["donors_demoted_by_escalation"] == 1
    assert s.stats.totals["prompts_withheld_a_donor"] == 2


def test_copies_of_one_prompt_and_its_scored_continuation_count_once(s):
    """Copies of a prompt served before the first one's figures came back, and a request
    scoring its continuation (semshare-bench's: prompt logprobs, a reuse limit at the prompt's
    end), are that one prompt, not a donor that many prompts found short. Before, one prompt
    sent twice demoted its donor for every prompt (seen through ``vllm serve``: a resent target
    escalated at each of its loads)."""
    copies = [request(f"t{i}", PROMPT) for i in range(3)]
    twin = request("twin", PROMPT + [9, 9, 9])
    twin.kv_transfer_params = {"semshare_reuse_limit": len(PROMPT) - 1}
    twin.sampling_params = SimpleNamespace(prompt_logprobs=1)
    specs = [load(s, r) for r in copies]  # all in flight before any figures
    for r, spec in zip(copies, specs):
        repaired(s, r, spec, escalations=1)
    repaired(s, twin, load(s, twin), escalations=1)
    record = s.index.get(specs[0].key)
    assert not record.demoted and record.escalations == 1
    assert s.stats.totals["prompts_withheld_a_donor"] == 1
    assert "donors_demoted_by_escalation" not in s.stats.totals


def test_what_counts_as_the_same_prompt():
    """The reusable prompt decides: a reuse limit cuts it; only a request asking for prompt
    logprobs past its limit scores a continuation (a client that caps reuse is not exempt)."""
    plain = request("p", PROMPT)
    capped = request("c", PROMPT + [9, 9, 9])
    capped.kv_transfer_params = {"semshare_reuse_limit": len(PROMPT) - 1}
    scoring = request("s", PROMPT + [9, 9, 9])
    scoring.kv_transfer_params = {"semshare_reuse_limit": len(PROMPT) - 1}
    scoring.sampling_params = SimpleNamespace(prompt_logprobs=1)
    served = [RequestState(r.request_id).served_prompt(r) for r in (plain, capped, scoring)]
    assert len({p.digest for p in served}) == 1
    assert [p.scoring for p in served] == [False, False, True]
    other = RequestState("o").served_prompt(request("o", DONOR[:150] + [6]))
    assert other.digest != served[0].digest
