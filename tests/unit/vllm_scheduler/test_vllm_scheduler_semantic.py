"""A semantic hit through vLLM's real scheduler: the same article behind another instruction (no
common prefix) waits for its donor search (vLLM re-asks), is claimed, and vLLM allocates for it;
the worker's load carries the alignment, its blocks never serve vLLM's exact prefix cache, and
the request is never captured. Real text, the real MiniLM embedder and aligner."""

import threading

import pytest
from support.vllm_engine_core import EngineCore, engine_config
from vllm.v1.outputs import KVConnectorOutput

from semshare_vllm.metadata import RepairReport, SemShareWorkerMetadata
from semshare_vllm.testbed.models import smollm2_tokenizer
from semshare_vllm.testbed.text import wiki_document


@pytest.fixture(scope="module")
def prompts():
    tok = smollm2_tokenizer()
    doc = wiki_document(3, 1800)
    donor = tok.encode(f"Summarise the following article in two sentences.\n\n{doc}")
    target = tok.encode(f"Question: which three facts in this text surprise most?\n\n{doc}")
    other = tok.encode(f"List the places and the dates this text names.\n\n{doc}")
    return donor, target, other


def core_with_embedded_donor(donor_ids, prefix_caching: bool):
    """vLLM's scheduler with our connector, discovery and aligner on, and the donor of
    ``donor_ids`` captured and embedded; (the engine core, the donor's key)."""
    # a deadline no busy CI machine reaches: the flow is under test here, not the deadline
    extra = {"embedder": "onnx", "lookup_deadline_ms": 60_000}
    core = EngineCore(engine_config(prefix_caching=prefix_caching, extra=extra))
    assert core.ours.search is not None  # discovery and the aligner are on
    donor = core.add(core.request(donor_ids))
    # the worker, once its caches are registered: its pool, and that it can repair
    ready = SemShareWorkerMetadata(capacity_bytes=1 << 30, recompute_ready=True)
    core.step(KVConnectorOutput(kv_connector_worker_meta=ready))
    key = core.capture(donor).key
    assert core.ours.discovery.wait_idle()  # the donor embedded on the discovery thread
    return core, key


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix-caching", "off"])
def test_a_reworded_prompt_is_served_from_its_donor_through_vllms_scheduler(
    prompts, prefix_caching
):
    core, key = core_with_embedded_donor(prompts[0], prefix_caching)
    target_ids = prompts[1]
    target = core.add(core.request(target_ids))  # its search starts on arrival
    out = core.step_until(lambda out: target.request_id in out.num_scheduled_tokens)
    (new,) = out.scheduled_new_reqs
    (load,) = out.kv_connector_metadata.loads
    assert out.has_sync_kv_loads  # started before the forward that reads it
    assert load.key == key and load.donor_pos is not None and load.policy == "adaptive"
    assert load.dst_start == 0 and new.num_computed_tokens == load.num_tokens
    assert load.num_tokens >= 0.7 * len(target_ids)  # most of the prompt is the article
    assert load.num_tokens < len(target_ids)  # vLLM computes the last token at least
    assert out.num_scheduled_tokens[target.request_id] == len(target_ids) - load.num_tokens
    assert load.block_ids == list(new.block_ids[0])
    assert load.token_ids == target_ids[: load.num_tokens]
    assert len(load.donor_pos) == load.num_tokens
    assert core.ours.stats.totals["semantic_hits"] == 1
    # approximate KV: the request's block hashes are its own, so vLLM's prefix cache never
    # serves these blocks to the same prompt as exact
    assert core.cached_hits(target_ids) == 0

    core.run_to_end(target)  # never captured: its blocks are freed at once
    delay, params = core.finished[target.request_id]
    assert delay is False and params["semshare_provenance"]["served"] == "semantic"
    assert target.request_id not in core.scheduler.requests
    assert not core.connector.has_pending_block_frees()
    core.connector.shutdown()
    core.assert_empty()


def test_a_semantic_hit_preempted_and_resumed_still_says_a_donor_served_it(prompts):
    """Preempted after its prefill (vLLM frees its blocks; they keep their salted hashes) and
    admitted again, the request gets its own approximate blocks back from vLLM's prefix cache:
    its answer still comes from the donor's KV, and its provenance must say so (it said
    "none", as if vLLM's exact cache had served it)."""
    import time

    core, key = core_with_embedded_donor(prompts[0], prefix_caching=True)
    target = core.add(core.request(prompts[1], max_tokens=6))
    out = core.step_until(lambda out: target.request_id in out.num_scheduled_tokens)
    (load,) = out.kv_connector_metadata.loads
    assert load.key == key and load.donor_pos is not None  # a semantic load
    core.step()  # a decode step
    core.scheduler.running.remove(target)  # as vLLM preempts under memory pressure
    core.scheduler._preempt_request(target, time.monotonic())
    core.run_to_end(target)
    figures = core.finished[target.request_id][1]["semshare_provenance"]
    assert figures["preemptions"] == 1
    assert figures["served"] == "semantic" and figures["donor"] is not None
    assert figures["semantic_tokens"] == load.num_tokens
    core.connector.shutdown()
    core.assert_empty()


def test_a_target_whose_load_escalated_is_computed_when_sent_again(prompts):
    """The gate escalated the target's loads (two copies of it in flight): sent again, the
    target is not served from that donor (its load would escalate again) but computed by vLLM
    and captured, a donor of its own; the donor is not demoted (it was, when one target had
    escalated twice) and goes on serving another target."""
    core, key = core_with_embedded_donor(prompts[0], prefix_caching=True)
    copies = [core.add(core.request(prompts[1], max_tokens=30)) for _ in range(2)]
    loads = {}

    def both_loaded(out):
        loads.update((spec.req_id, spec) for spec in out.kv_connector_metadata.loads)
        return len(loads) == 2

    core.step_until(both_loaded)
    assert all(spec.key == key and spec.donor_pos is not None for spec in loads.values())
    reports = [
        RepairReport(r.request_id, loads[r.request_id].seq, 0.3, 0.1, 0.01, 0.03, escalations=1)
        for r in copies
    ]
    core.step(KVConnectorOutput(kv_connector_worker_meta=SemShareWorkerMetadata(repairs=reports)))
    totals = core.ours.stats.totals
    assert totals["prompts_withheld_a_donor"] == 1
    assert not core.ours.index.get(key).demoted

    other = core.add(core.request(prompts[2]))  # another instruction: still served
    out = core.step_until(lambda out: other.request_id in out.num_scheduled_tokens)
    (spec,) = out.kv_connector_metadata.loads
    assert spec.key == key and spec.donor_pos is not None
    for r in (*copies, other):
        core.run_to_end(r)
    assert core.finished[copies[0].request_id][1]["semshare_provenance"]["escalations"] == 1

    again = core.add(core.request(prompts[1]))
    out = core.step_until(lambda out: again.request_id in out.num_scheduled_tokens)
    assert not out.kv_connector_metadata.loads
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0
    core.capture(again)  # exact KV: kept as a donor
    assert not core.ours.index.get(key).demoted
    assert totals["semantic_hits"] == 3 and totals["prompts_withheld_a_donor"] == 1
    core.connector.shutdown()
    core.assert_empty()


def test_a_donor_withheld_while_the_prompt_aligns_is_not_loaded(prompts):
    """A copy of the target arrives while the first copy's load is in flight, finds the donor,
    and is being aligned to it when the first copy's escalation comes back: the donor is now
    withheld from that prompt, and the plan made from the finished alignment must say so
    (``SemanticSearch.plan``'s re-check; the search's and the alignment's own checks ran
    before the report came). The copy is computed by vLLM."""
    core, key = core_with_embedded_donor(prompts[0], prefix_caching=True)
    # decoding while the copy's search runs (however slow the machine): still live when its
    # report comes
    first = core.add(core.request(prompts[1], max_tokens=1000))
    out = core.step_until(lambda out: first.request_id in out.num_scheduled_tokens)
    (spec,) = out.kv_connector_metadata.loads
    assert spec.key == key and spec.donor_pos is not None

    search = core.ours.search
    aligner, release, started = search.aligner, threading.Event(), threading.Event()

    class HeldAligner:  # the real aligner, its alignments held until the report is in
        def best(self, *args, **kwargs):
            started.set()
            assert release.wait(60)
            return aligner.best(*args, **kwargs)

        def __getattr__(self, name):
            return getattr(aligner, name)

    search.aligner = HeldAligner()
    try:
        copy = core.add(core.request(prompts[1], max_tokens=30))
        core.step_until(lambda out: started.is_set())
        assert core.ours.requests[copy.request_id].job.kind == "align"
        assert not first.is_finished()
        escalated = RepairReport(first.request_id, spec.seq, 0.3, 0.1, 0.01, 0.03, escalations=1)
        reported = SemShareWorkerMetadata(repairs=[escalated])
        core.step(KVConnectorOutput(kv_connector_worker_meta=reported))
        assert core.ours.stats.totals["prompts_withheld_a_donor"] == 1
    finally:
        release.set()

    out = core.step_until(lambda out: copy.request_id in out.num_scheduled_tokens)
    assert not out.kv_connector_metadata.loads
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0
    assert core.ours.stats.totals["semantic_hits"] == 1  # the first copy's only
    search.aligner = aligner
    core.capture(copy)  # exact KV: kept as a donor
    core.run_to_end(first, max_steps=1100)
    assert core.finished[copy.request_id][1]["semshare_provenance"]["served"] == "none"
    core.connector.shutdown()
    core.assert_empty()
