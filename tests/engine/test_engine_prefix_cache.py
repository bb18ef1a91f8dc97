"""The connector beside vLLM's own prefix cache (vLLM's default): it stays out of the way while
vLLM's cache holds a prefix, serves it once vLLM has evicted it, and the answer is cold's."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from semshare_vllm.testbed import models, offline

pytestmark = pytest.mark.engine


def test_connector_serves_what_vllms_prefix_cache_evicted():
    model = str(models.tiny_llama())
    script = Path(__file__).parent / "scenarios" / "prefix_cache_on.py"
    proc = subprocess.run(
        [sys.executable, str(script), model],
        capture_output=True,
        text=True,
        env=dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1"),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    b = out["b_after_eviction"]
    assert out["hit_tokens_before_eviction"] == 0  # vLLM's own cache served the first repeat
    assert out["b_with_vllm_cache"]["num_cached_tokens"] > 0
    claim = out["scheduler"]["hit_tokens"]
    assert claim > 0 and b["num_cached_tokens"] >= claim
    assert out["worker"]["loaded_tokens"] == claim
    assert out["scheduler"]["lookups"] == 7  # once per request, though vLLM re-asks waiting ones
    cold = offline.reference_outputs(model, [out["prompt_b"]], 12)[0]
    assert b["token_ids"] == out["b_with_vllm_cache"]["token_ids"] == cold["token_ids"]


def test_a_repair_over_a_prefix_computed_in_the_same_step_is_not_run(model, tok):
    """A and B in one batch, B's prefix being vLLM's own hit on blocks A's forward writes in
    that very step: B's load (repaired under recompute_policy "all") would attend over KV not
    written yet. It is reported failed instead, vLLM computes B's claim, and B answers as cold;
    with A computed a step earlier, the same load runs."""
    from semshare_vllm.testbed.text import wiki_document

    bs = offline.BLOCK_SIZE
    donor = tok(wiki_document(11, 5000))["input_ids"][: 20 * bs + 5]
    a = donor[: 6 * bs] + tok(" Now translate all of that into French, please.")["input_ids"]
    b = donor[: 18 * bs] + tok("\n\nQuestion: what is this text about? Answer:")["input_ids"]
    cold = offline.reference_outputs(model, [b], 8)[0]
    llm = offline.semshare_llm(
        model, {"host_store_bytes": "512MiB", "recompute_policy": "all"}, enable_prefix_caching=True
    )
    sched, worker = offline.connector_halves(llm)
    off = offline.greedy(8, kv_transfer_params={"semshare": "off"})
    filler = {"prompt_token_ids": tok("filler text for one more step")["input_ids"]}

    def run(prompts, params):
        requests = [{"prompt_token_ids": p} for p in prompts]
        return offline.summarize(llm.generate(requests, params, use_tqdm=False))

    run([donor], [offline.greedy(8)])
    llm.generate([filler], off, use_tqdm=False)  # a step: the donor is captured
    worker.flush_captures()

    def settle():
        for _ in range(3):  # captures done and their blocks released
            llm.generate([filler], off, use_tqdm=False)
            worker.flush_captures()
        assert llm.reset_prefix_cache()

    settle()
    run([a], [off])  # A's blocks written in their own step
    (earlier,) = run([b], [offline.greedy(8)])
    served = earlier["kv_transfer_params"]["semshare_provenance"]
    assert served["vllm_cached_tokens"] == 6 * bs and not served["load_failed"]
    assert sched.stats.totals.get("loads_behind_unwritten_prefix", 0) == 0
    assert earlier["token_ids"] == cold["token_ids"]

    settle()
    _, same = run([a, b], [off, offline.greedy(8)])
    served = same["kv_transfer_params"]["semshare_provenance"]
    assert served["vllm_cached_tokens"] == 6 * bs and served["load_failed"]
    assert sched.stats.totals["loads_behind_unwritten_prefix"] == 1
    assert same["token_ids"] == cold["token_ids"]
    assert max(abs(x - y) for x, y in zip(same["logprobs"], cold["logprobs"])) < 1e-3
