"""Quantised KV on the real CPU engine (``--kv-cache-dtype fp8_e5m2``, per-tensor scales): the
connector serves exact prefixes only (page copies of the same bytes), with no discovery, no RoPE
correction and no recompute; every answer equals the same engine's cold one."""

import pytest

from semshare_vllm.testbed import models, offline
from semshare_vllm.testbed.text import wiki_document


def _cpu_runs_fp8_kv() -> bool:
    """vLLM's CPU attention takes fp8 KV only on x86 with AVX-512 or AMX (it raises at engine
    start-up otherwise; ``cpu_attn.py``): the machines this suite runs on differ in that."""
    import torch

    return torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()


pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(
        not _cpu_runs_fp8_kv(),
        reason="vLLM's CPU backend runs fp8 KV only with AVX-512 or AMX; this CPU has neither",
    ),
]

OFF = {"semshare": "off"}


@pytest.fixture(scope="module")
def model():
    return str(models.tiny_llama())


@pytest.fixture(scope="module")
def llm(model):
    return offline.semshare_llm(model, {"host_store_bytes": "256MiB"}, kv_cache_dtype="fp8_e5m2")


def gen(llm, prompt, salt=None, kv=None):
    request = {"prompt_token_ids": prompt}
    if salt is not None:
        request["cache_salt"] = salt
    params = offline.greedy(12, logprobs=None, kv_transfer_params=kv or None)
    out = llm.generate([request], params, use_tqdm=False)[0]
    return list(out.outputs[0].token_ids), out.num_cached_tokens


def test_fp8_kv_is_served_by_exact_prefix_only(model, llm):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)

    def ids(text):
        return tok(text, add_special_tokens=False)["input_ids"]

    sched, worker = offline.connector_halves(llm)
    assert sched.geometry.exact_only and "fp8" in sched.geometry.exact_only
    assert sched.discovery is None and worker.kv.repairer is None and not worker.disabled
    doc = wiki_document(4000, 1500)
    exact = ids(doc + "\n\nSummarize the passage above in one sentence:")
    moved = ids("Read this first.\n\n" + doc + "\n\nSummarize the passage above:")
    cold_exact, _ = gen(llm, exact, salt="cold-1", kv=OFF)
    cold_moved, _ = gen(llm, moved, salt="cold-2", kv=OFF)
    gen(llm, ids(doc + "\n\nQuestion: What is the text above about? Answer:"))  # the donor
    gen(llm, ids("filler " * 40), kv=OFF)  # a step: the donor is captured
    worker.flush_captures()
    out, cached = gen(llm, exact)
    assert cached >= 0.8 * len(exact) and out == cold_exact  # exact pages: the same bytes
    out, cached = gen(llm, moved)
    assert cached == 0 and out == cold_moved  # nothing moved or repaired
    assert sched.stats.totals.get("semantic_lookups", 0) == 0
    assert not worker.stats.totals.get("load_failures")
