"""Semantic hits end to end in a real vLLM engine (offline LLM, CPU, SmolLM2-135M, real text,
vLLM's prefix caching ON): discovery finds the donor, alignment maps it, the worker moves its KV
with RoPE correction and repairs it (CacheBlend), and the approximate blocks never become exact
prefix-cache hits."""

import math

import pytest

from semshare_vllm.testbed import offline
from semshare_vllm.testbed.text import wiki_document

pytestmark = pytest.mark.engine

MAX_TOKENS = 8
HEAD_A = "Read the article below and answer the question after it.\n\n"
HEAD_B = (
    "You are a careful assistant. The following text comes from an encyclopedia; read "
    "all of it before you answer, and answer in one short sentence.\n\n"
)


@pytest.fixture(scope="module")
def prompts(tok):
    def ids(text):
        return tok(text)["input_ids"]

    doc, gone = wiki_document(700, 2000), wiki_document(1100, 2000)
    return {
        "a": ids(HEAD_A + doc + "\n\nQuestion: What is this article about? Answer:"),
        "b": ids(HEAD_B + doc + "\n\nQuestion: Who or what is the subject? Answer:"),
        "c": ids(wiki_document(900, 1500) + "\n\nSummary:"),
        "gone_a": ids(HEAD_A + gone + "\n\nQuestion: What is this article about? Answer:"),
        "gone_b": ids(HEAD_B + gone + "\n\nQuestion: Who or what is the subject? Answer:"),
        # semshare-bench's first 2K cross-instruction pair: a plain-text donor, a chat-template
        # target of the same document (test_a_chat_template_target_..._answers_as_cold)
        **dict(zip(("x_donor", "x_target"), (ids(r.prompt) for r in bench_pair(tok)))),
    }


def bench_pair(tok):
    from semshare_vllm.bench import workloads

    return workloads.build("cross-instruction", 1, 2048, workloads.Sizer(tok), 0)


@pytest.fixture(scope="module")
def references(model, prompts):
    names = ("b", "gone_b", "x_target")
    outs = offline.reference_outputs(model, [prompts[n] for n in names], MAX_TOKENS)
    return dict(zip(names, outs))


@pytest.fixture(scope="module")
def reference(references):
    return references["b"]


@pytest.fixture(scope="module", autouse=True)
def _donors_stay_offered():
    """The module's tests are served by the same donor, the same target again and again, and
    its loads may escalate or be declined (the gate test makes them): the donor would then be
    withheld from that target, which would end the tests after it. Withholding and demotion
    have their own tests (tests/unit/scheduler/test_withheld_donors.py)."""
    from semshare_vllm.catalog.donor_index import DonorRecord

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(DonorRecord, "withheld", lambda record, digest, scoring: False)
        yield


@pytest.fixture(scope="module")
def llm(model):
    return offline.semshare_llm(
        model,
        {"host_store_bytes": "512MiB", "lookup_deadline_ms": 20000},
        enable_prefix_caching=True,
    )


@pytest.fixture(scope="module")
def sched(llm):
    return offline.connector_halves(llm)[0]


@pytest.fixture(scope="module")
def worker(llm):
    return offline.connector_halves(llm)[1]


def run(llm, prompt, salt=None):
    return offline.run(llm, prompt, MAX_TOKENS, salt)


def donor_ready(llm, sched, worker, filler):
    """Let the last finished request be captured and embedded."""
    run(llm, filler)  # one more step starts the capture
    worker.flush_captures()
    sched.discovery.wait_idle()
    run(llm, filler)  # the scheduler takes the embeddings in
    sched.discovery.wait_idle()


def totals(sched, worker):
    return {**sched.stats.totals, **worker.stats.totals}


def test_semantic_hit_reuses_most_of_the_prompt_and_answers_as_cold(
    llm, sched, worker, prompts, reference, monkeypatch
):
    run(llm, prompts["a"])
    donor_ready(llm, sched, worker, prompts["c"])
    assert sched.recompute_ready
    waits, recompute = [], worker.kv.repairer.runner.recompute

    def watched(*args, **kw):
        waits.append(kw.get("donor_kv_ready") and kw["donor_kv_ready"][0])
        return recompute(*args, **kw)

    monkeypatch.setattr(worker.kv.repairer.runner, "recompute", watched)
    before = totals(sched, worker)
    out = run(llm, prompts["b"])
    assert waits == [1]  # on CPU the move ran beside layer 0, waited for before layer 1
    after = totals(sched, worker)
    claimed = after["hit_tokens"] - before.get("hit_tokens", 0)
    assert after["semantic_hits"] - before.get("semantic_hits", 0) == 1
    assert claimed >= 0.7 * len(prompts["b"])
    assert after["recomputed_tokens"] > before.get("recomputed_tokens", 0)
    assert (
        after["recomputed_token_layers"] - before.get("recomputed_token_layers", 0)
        < 0.6 * claimed * 30
    )  # CacheBlend: far from recomputing everything
    assert out["token_ids"][0] == reference["token_ids"][0]
    # what vllm.LLM hands back (in process): the request's provenance
    served = out["kv_transfer_params"]["semshare_provenance"]
    assert served["served"] == "semantic" and served["semantic_tokens"] == claimed
    assert served["repair_report"] == "received" and 0 < served["recompute_share"] < 0.6

    # The same prompt again: vLLM's prefix cache must not serve the approximate blocks as an
    # exact hit. It is a semantic hit again (the approximate request was not made a donor).
    again = run(llm, prompts["b"])
    final = totals(sched, worker)
    assert final["semantic_hits"] - after["semantic_hits"] == 1
    assert final["hit_tokens"] - after["hit_tokens"] == claimed
    assert again["num_cached_tokens"] == out["num_cached_tokens"]


def test_prefix_caching_is_on_for_fully_computed_prompts(llm, sched, prompts):
    """Control: a prompt vLLM computed itself is served from vLLM's own prefix cache."""
    hits = sched.stats.totals.get("hit_tokens", 0)
    run(llm, prompts["c"])
    again = run(llm, prompts["c"])
    assert again["num_cached_tokens"] >= 0.8 * len(prompts["c"])
    assert sched.stats.totals.get("hit_tokens", 0) == hits  # vLLM's cache, not ours


def test_other_tenants_get_no_semantic_hit(llm, sched, prompts):
    hits = sched.stats.totals.get("semantic_hits", 0)
    out = run(llm, prompts["b"], salt="tenant-b")
    assert sched.stats.totals.get("semantic_hits", 0) == hits
    assert out["num_cached_tokens"] == 0


@pytest.mark.parametrize(
    ("decline_share", "echo_span", "echo_share"),
    [(1.0, 0, 0.1), (0.5, 0, 0.1), (0.5, 24, 1.0)],
    ids=["all", "gate", "echoes"],
)
def test_with_an_error_bound_of_zero_the_gate_fails_closed_and_the_hit_answers_as_cold(
    llm, sched, worker, prompts, reference, monkeypatch, decline_share, echo_span, echo_share
):
    """Fail-closed: the check layer may keep at most 30% of the tokens, and the adaptive
    policy's gate then finds error left above a bound of 0. Allowed to
    escalate to every loaded token (decline share 1.0), the same recompute does so; at the
    default 0.5 it declines the load instead and vLLM computes the prompt. Either way the
    request answers exactly as cold (tokens and logprobs), and its provenance says why.

    With echoes off (``echo_span`` 0) the check layer's first choice is under half of this
    short prompt, so the decline comes at the gate, after an escalation; with echoes (24) and
    no cap on their share (``echo_share`` 1.0) the always-recomputed tokens and the 30% are
    already over half, and the load is declined at the check layer (seen while echoes were on
    by default, before the cap)."""
    from dataclasses import replace

    run(llm, prompts["a"])  # (already a donor after the first test; harmless)
    donor_ready(llm, sched, worker, prompts["c"])
    strict = replace(
        worker.loads.config,
        recompute_error_bound=0.0,
        recompute_max_share=0.3,
        recompute_decline_share=decline_share,
    )
    monkeypatch.setattr(worker.loads, "config", strict)
    planned = replace(  # the scheduler plans the always-recomputed set
        sched.search.config, recompute_echo_span=echo_span, recompute_echo_max_share=echo_share
    )
    monkeypatch.setattr(sched.search, "config", planned)
    monkeypatch.setattr(sched.search.aligner, "echoes", echo_span > 0)  # and marks the echoes
    before = totals(sched, worker)
    out = run(llm, prompts["b"])
    after = totals(sched, worker)
    assert after["semantic_hits"] - before.get("semantic_hits", 0) == 1
    prov = out["kv_transfer_params"]["semshare_provenance"]
    assert prov["served"] == "semantic"
    if echo_span == 0:  # the gate ran and escalated
        escalated = after["recompute_escalated_loads"] - before.get("recompute_escalated_loads", 0)
        assert escalated == 1 and prov["escalations"] >= 1 and prov["gate_residual"] > 0
    else:
        assert prov["escalations"] == 0 and prov["gate_residual"] is None
    if decline_share == 1.0:
        assert prov["recompute_share"] >= 1.0 and not prov["declined"]
    else:
        assert prov["declined"] and prov["load_failed"]
        assert after["recompute_declined"] - before.get("recompute_declined", 0) == 1
    assert out["token_ids"] == reference["token_ids"]
    assert max(abs(x - y) for x, y in zip(out["logprobs"], reference["logprobs"])) < 1e-3


def test_a_chat_template_target_of_another_instructions_donor_answers_as_cold(
    llm, sched, worker, prompts, references
):
    """Regression: the target's chat-template instruction differs from the donor's, and the
    sentence and LSH stages align some of its tokens to the same tokens of the donor's
    instruction, outside any run (a lone newline taking the donor's newline after other
    words). Their donor KV was loaded unrecomputed: the gate passed the hit (8.5% recomputed)
    and its first greedy token was not cold's. Every aligned stretch's head is redone now."""
    run(llm, prompts["x_donor"])
    donor_ready(llm, sched, worker, prompts["c"])
    before = totals(sched, worker)
    out = run(llm, prompts["x_target"])
    after = totals(sched, worker)
    assert after["semantic_hits"] - before.get("semantic_hits", 0) == 1
    prov = out["kv_transfer_params"]["semshare_provenance"]
    assert prov["served"] == "semantic" and not prov["load_failed"]
    assert prov["semantic_tokens"] >= 0.9 * len(prompts["x_target"])
    assert prov["recompute_share"] < 0.3  # a cheap hit, not an escalation to everything
    assert out["token_ids"] == references["x_target"]["token_ids"]


def test_a_donor_gone_before_its_load_is_computed_by_vllm_and_forgotten(
    llm, sched, worker, prompts, references
):
    from semshare_vllm.core.keys import DonorKey, donor_id_for

    out = run(llm, prompts["gone_a"])
    key = DonorKey("", donor_id_for("", prompts["gone_a"] + out["token_ids"][:-1]))
    donor_ready(llm, sched, worker, prompts["c"])
    assert key in sched.index and key in worker.kv.store
    worker.kv.store.drop(key)  # the worker lost it; the scheduler does not know yet
    failures = worker.stats.totals.get("load_failures", 0)
    hits = sched.stats.totals.get("semantic_hits", 0)
    got = run(llm, prompts["gone_b"])
    assert sched.stats.totals["semantic_hits"] == hits + 1  # planned and claimed...
    assert worker.stats.totals["load_failures"] == failures + 1  # ...the load failed...
    assert got["token_ids"] == references["gone_b"]["token_ids"]  # ...and vLLM computed it
    assert got["kv_transfer_params"]["semshare_provenance"]["load_failed"] is True
    run(llm, prompts["c"])  # the report comes back
    assert key not in sched.index  # forgotten


def score(llm, prompt: list[int], limit: int | None = None, salt: str | None = None):
    """Prompt logprobs of ``prompt``: (logprob, rank) of each token from the second on."""
    from vllm import SamplingParams

    extra = {"kv_transfer_params": {"semshare_reuse_limit": limit}} if limit is not None else None
    request = {"prompt_token_ids": prompt}
    if salt is not None:
        request["cache_salt"] = salt
    out = llm.generate(
        [request],
        SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, extra_args=extra),
        use_tqdm=False,
    )[0]
    rows = out.prompt_logprobs[1:]
    return [(row[tok].logprob, row[tok].rank) for row, tok in zip(rows, prompt[1:])]


def test_a_continuation_is_scored_after_a_reused_prompt(llm, sched, worker, prompts, tok):
    """``semshare_reuse_limit``: a request asking for prompt logprobs (which turns vLLM's prefix
    caching off) gets the target prompt from a semantic hit and vLLM's own scores for the
    continuation after it; the served rows are marked (rank 0), never uninitialised."""
    run(llm, prompts["a"])
    donor_ready(llm, sched, worker, prompts["c"])
    head = prompts["b"]
    continuation = tok(
        " The article describes the history of the subject and its most important events.",
        add_special_tokens=False,
    )["input_ids"]
    full = head + continuation
    # no limit: vLLM computes everything (another tenant: this exact prompt is no donor for ours)
    cold = score(llm, full, salt="scoring-cold")
    before = totals(sched, worker)
    hit = score(llm, full, limit=len(head) - 1)
    after = totals(sched, worker)
    claimed = after["hit_tokens"] - before.get("hit_tokens", 0)
    assert after["semantic_hits"] - before.get("semantic_hits", 0) == 1, {
        k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)
    }
    assert 0.7 * len(head) <= claimed <= len(head) - 1
    assert {rank for _, rank in hit[: claimed - 1]} == {0}  # served: marked
    assert all(rank >= 1 for _, rank in hit[len(head) - 1 :])  # scored by vLLM
    tail_hit = [lp for lp, _ in hit[len(head) - 1 :]]
    tail_cold = [lp for lp, _ in cold[len(head) - 1 :]]
    assert len(tail_hit) == len(continuation)
    ratio = math.exp((sum(tail_cold) - sum(tail_hit)) / len(continuation))
    assert 0.8 < ratio < 1.25, ratio  # perplexity hit / cold
    assert all(rank >= 1 for _, rank in cold)


def test_a_scored_request_whose_load_failed_gets_every_row_from_vllm(llm, sched, worker, tok):
    """A request asking for prompt logprobs (``semshare_reuse_limit``) whose load fails: vLLM
    computes its prompt again from the start, and every row of its prompt logprobs must be the
    one cold computes (none marked, none missing, none from the failed step)."""
    from semshare_vllm.core.keys import DonorKey, donor_id_for

    head = tok(wiki_document(1300, 1500) + "\n\nSummary:")["input_ids"]
    out = run(llm, head)
    key = DonorKey("", donor_id_for("", head + out["token_ids"][:-1]))
    run(llm, tok("Another request, so that the donor is captured.")["input_ids"])
    worker.flush_captures()
    assert key in worker.kv.store
    worker.kv.store.drop(key)  # the worker lost it; the scheduler does not know yet
    full = (
        head
        + tok(" The text is about a place and its people.", add_special_tokens=False)["input_ids"]
    )
    cold = score(llm, full, salt="scoring-cold-2")
    failures = worker.stats.totals.get("load_failures", 0)
    hits = sched.stats.totals.get("hits", 0)
    got = score(llm, full, limit=len(head) - 1)
    assert sched.stats.totals["hits"] == hits + 1  # claimed...
    assert worker.stats.totals["load_failures"] == failures + 1  # ...its load failed
    assert len(got) == len(cold) == len(full) - 1
    assert [rank for _, rank in got] == [rank for _, rank in cold]
    assert max(abs(a - b) for (a, _), (b, _) in zip(got, cold)) < 1e-3
