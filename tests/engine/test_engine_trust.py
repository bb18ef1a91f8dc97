"""Reused KV served only where it is right, in a real engine set up as users run vLLM: prefix
caching on, vLLM's default block size (128 on CPU), SmolLM2-135M, real text.
Every answer is checked against vLLM's own cold computation of the same prompt (the connector
opted out, under a fresh cache_salt, in the same engine)."""

import pytest

from semshare_vllm.core.keys import DonorKey, donor_id_for
from semshare_vllm.testbed import offline
from semshare_vllm.testbed.text import wiki_document

pytestmark = pytest.mark.engine

MAX_TOKENS = 8
OFF = {"semshare": "off"}
HEAD_A = "Read the article below and answer the question after it.\n\n"
HEAD_B = (
    "You are a careful assistant. The following text comes from an encyclopedia; read "
    "all of it before you answer, and answer in one short sentence.\n\n"
)
Q1 = "\n\nQuestion: What is this article about? Answer:"
Q2 = "\n\nQuestion: Who or what is the subject? Answer:"


@pytest.fixture(scope="module")
def prompts(tok):
    def ids(text):
        return tok(text)["input_ids"]

    out = {}
    doc = wiki_document(700, 2000)
    out["semantic"] = (ids(HEAD_A + doc + Q1), ids(HEAD_B + doc + Q2))
    doc = wiki_document(1700, 2000)  # one document, two questions: an exact prefix
    out["fail"] = (ids(doc + Q1), ids(doc + Q2))
    out["filler"] = ids(wiki_document(900, 600) + "\n\nSummary:")
    out["more"] = tok("\n\nAnd what happened next?", add_special_tokens=False)["input_ids"]
    return out


@pytest.fixture(scope="module")
def llm(model):
    return offline.semshare_llm(
        model,
        {"host_store_bytes": "512MiB", "lookup_deadline_ms": 20000},
        enable_prefix_caching=True,
        block_size=None,
    )


@pytest.fixture(scope="module")
def halves(llm):
    sched, worker = offline.connector_halves(llm)
    assert sched.geometry.block_size == 128  # vLLM's default on CPU
    return sched, worker


def gen(llm, prompt, max_tokens=MAX_TOKENS, salt=None, kv=None):
    request = {"prompt_token_ids": prompt}
    if salt is not None:
        request["cache_salt"] = salt
    params = offline.greedy(max_tokens, logprobs=None, kv_transfer_params=kv or None)
    out = llm.generate([request], params, use_tqdm=False)[0]
    return {"token_ids": list(out.outputs[0].token_ids), "num_cached_tokens": out.num_cached_tokens}


def settle(llm, halves, filler):
    """Let the last finished request be captured and embedded."""
    sched, worker = halves
    gen(llm, filler, 1, kv=OFF)
    worker.flush_captures()
    sched.discovery.wait_idle()
    gen(llm, filler, 1, kv=OFF)
    sched.discovery.wait_idle()


def count(halves, name):
    sched, worker = halves
    return sched.stats.totals.get(name, 0) + worker.stats.totals.get(name, 0)


def test_a_semantic_hit_its_decode_and_the_next_turn_never_meet_in_vllms_prefix_cache(
    llm, halves, prompts
):
    """Approximate KV is request-only in vLLM's prefix cache, the partial block its decode fills
    included: the next turn, with the connector opted out, gets nothing from vLLM's cache."""
    a, b = prompts["semantic"]
    gen(llm, a)
    settle(llm, halves, prompts["filler"])
    semantic, claimed = count(halves, "semantic_hits"), count(halves, "hit_tokens")
    fill = 128 - len(b) % 128 + 2  # decoding fills the prompt's last block
    out = gen(llm, b, max_tokens=fill)
    assert count(halves, "semantic_hits") == semantic + 1
    assert count(halves, "hit_tokens") - claimed >= 0.7 * len(b)
    turn = b + out["token_ids"] + prompts["more"]
    cold = gen(llm, turn, salt="cold-turn", kv=OFF)
    nxt = gen(llm, turn, kv=OFF)
    assert nxt["num_cached_tokens"] == 0
    assert nxt["token_ids"] == cold["token_ids"]


def test_a_failed_load_then_abort_leaves_no_unwritten_kv_for_the_next_request(llm, halves, prompts):
    """vLLM caches a request's blocks before the worker loads them, and with the connector's
    "recompute" failure policy it keeps them cached for the request to recompute. Here the
    request is aborted first: the same prompt, connector opted out, must get none of them."""

    sched, worker = halves
    a, b = prompts["fail"]
    cold = gen(llm, b, salt="cold-fail", kv=OFF)
    donor = gen(llm, a)
    settle(llm, halves, prompts["filler"])
    key = DonorKey("", donor_id_for("", a + donor["token_ids"][:-1]))
    assert key in worker.kv.store
    assert llm.reset_prefix_cache()  # vLLM forgets the document: only our donor has it
    for cache in worker.kv.caches:
        cache.zero_()  # what never-written blocks hold in this test
    worker.kv.store.drop(key)  # the donor is gone: its (exact) load fails
    failures = count(halves, "load_failures")
    engine = llm.llm_engine
    params = offline.greedy(MAX_TOKENS, logprobs=None, kv_transfer_params={"semshare": "exact"})
    engine.add_request("fails-then-aborts", {"prompt_token_ids": b}, params)
    engine.step()  # claimed, the load fails, vLLM rewinds the request
    assert count(halves, "load_failures") == failures + 1
    engine.abort_request(["fails-then-aborts"])
    while engine.has_unfinished_requests():
        engine.step()
    again = gen(llm, b, kv=OFF)
    assert again["num_cached_tokens"] == 0
    assert again["token_ids"] == cold["token_ids"]
    assert not any(
        len(r.token_ids) >= len(b) - 1 and r.token_ids[: len(b) - 1] == b[:-1]
        for r in sched.index.records()
    )  # and it was not kept as a donor
