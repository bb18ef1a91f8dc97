"""LoRA on the real CPU engine (SmolLM2-135M, a random rank-8 adapter made here): a donor serves
only requests with its own adapter, exact prefixes within the adapter answer as cold does, and
selective recompute (so semantic reuse) is off, since the model's LoRA layers would apply the
running batch's adapters to a repair. Cold answers come from the same engine with the connector
opted out under a fresh cache_salt."""

import json
from pathlib import Path

import pytest
from support.lifetimes import lifetime as run_lifetime

from semshare_vllm.testbed import models, offline
from semshare_vllm.testbed.text import wiki_document

pytestmark = pytest.mark.engine

OFF = {"semshare": "off"}
HEAD = "Read the article below and answer the question after it.\n\n"


def write_adapter(model_dir, path, seed: int = 0) -> str:
    """A random rank-8 LoRA adapter (PEFT format) for the model at ``model_dir``, strong enough
    to change the answers; another ``seed``, other weights in files of the same names."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    kv = cfg["num_key_value_heads"] * (cfg.get("head_dim") or hidden // cfg["num_attention_heads"])
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for i in range(layers):
        for name, out in (("q_proj", hidden), ("k_proj", kv), ("v_proj", kv)):
            prefix = f"base_model.model.model.layers.{i}.self_attn.{name}"
            weights[prefix + ".lora_A.weight"] = torch.randn(8, hidden, generator=g) * 0.05
            weights[prefix + ".lora_B.weight"] = torch.randn(out, 8, generator=g) * 0.05
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "r": 8,
                "lora_alpha": 16,
                "bias": "none",
                "task_type": "CAUSAL_LM",
                "target_modules": ["q_proj", "k_proj", "v_proj"],
                "base_model_name_or_path": str(model_dir),
            }
        )
    )
    return str(path)


@pytest.fixture(scope="module")
def adapter(model, tmp_path_factory):
    return write_adapter(models.smollm2(), tmp_path_factory.mktemp("lora"))


@pytest.fixture(scope="module")
def llm(model):
    return offline.semshare_llm(
        model, {"host_store_bytes": "512MiB"}, enable_lora=True, max_lora_rank=8, max_loras=1
    )


def gen(llm, prompt, lora=None, salt=None, kv=None):
    from vllm import SamplingParams

    request = {"prompt_token_ids": prompt}
    if salt is not None:
        request["cache_salt"] = salt
    params = SamplingParams(
        max_tokens=8,
        temperature=0.0,
        ignore_eos=True,
        extra_args={"kv_transfer_params": kv} if kv else None,
    )
    out = llm.generate([request], params, lora_request=lora, use_tqdm=False)[0]
    return list(out.outputs[0].token_ids), out.num_cached_tokens


def test_a_donor_serves_only_requests_with_its_own_lora_adapter(model, llm, adapter):
    from transformers import AutoTokenizer
    from vllm.lora.request import LoRARequest

    tok = AutoTokenizer.from_pretrained(model)

    def ids(text):
        return tok(text)["input_ids"]

    sched, worker = offline.connector_halves(llm)
    assert worker.kv.repairer is None and not sched.recompute_ready  # no repair under LoRA
    lora = LoRARequest("random", 1, adapter)
    doc = wiki_document(1300, 2000)
    a = ids(HEAD + doc + "\n\nQuestion: What is this article about? Answer:")
    b = ids(HEAD + doc + "\n\nQuestion: Who or what is the subject? Answer:")
    cold_plain, _ = gen(llm, b, salt="cold-plain", kv=OFF)
    cold_lora, _ = gen(llm, b, lora=lora, salt="cold-lora", kv=OFF)
    assert cold_lora != cold_plain  # the adapter changes the answer

    def settle():
        gen(llm, ids("filler " * 40), kv=OFF)  # a step: the donor is captured
        worker.flush_captures()

    gen(llm, a)  # a donor computed without the adapter
    settle()
    hits = sched.stats.totals.get("hits", 0)
    served, cached = gen(llm, b, lora=lora)
    assert cached == 0 and sched.stats.totals.get("hits", 0) == hits
    assert served == cold_lora
    gen(llm, a, lora=lora)  # a donor with the adapter
    settle()
    served, cached = gen(llm, b, lora=lora)  # its exact prefix, same adapter
    assert cached >= 0.7 * len(b) and served == cold_lora
    plain, cached = gen(llm, b)  # no adapter: the plain donor only
    assert plain == cold_plain


def lifetime(model, persist_dir, tmp_path, **job):
    return run_lifetime(model, persist_dir, tmp_path, 8, **job)


def test_a_persisted_lora_donor_is_not_served_once_its_adapter_is_rewritten(tmp_path):
    """vLLM keys an adapter by name and path, in a prefix cache that dies with its process; a
    persisted donor outlives it. Retrained at the same path (same file names), the adapter's
    old donor is restored but never claimed, and the answer is the new adapter's cold one."""
    from transformers import AutoTokenizer

    model = models.tiny_llama()
    tok = AutoTokenizer.from_pretrained(str(model))

    def ids(text):
        return tok(text, add_special_tokens=False)["input_ids"]

    doc = ids(wiki_document(700, 900))
    a, b = doc + ids("\n\nQuestion: what is this about?"), doc + ids("\n\nSummarize it:")
    path = write_adapter(model, tmp_path / "adapters" / "support", seed=0)
    persist, lora = tmp_path / "donors", ["support", path]

    first = lifetime(
        model, persist, tmp_path, prompt=a, lora=lora, capture=True, filler=ids("x " * 40)
    )
    assert first["restored"] == 0 and first["worker"]["captured_donors"] >= 1
    same = lifetime(model, persist, tmp_path, prompt=b, lora=lora, cold=True)
    assert same["restored"] >= 1 and same["scheduler"]["hit_tokens"] > 0  # control
    assert same["out"]["token_ids"] == same["cold"]["token_ids"]

    write_adapter(model, path, seed=1)  # retrained in place
    other = lifetime(model, persist, tmp_path, prompt=b, lora=lora, cold=True)
    assert other["fingerprint"] == first["fingerprint"]  # the base model did not change
    assert other["restored"] >= 1  # the old donor is back, in its own namespace
    assert other["scheduler"].get("hit_tokens", 0) == 0
    assert other["out"]["num_cached_tokens"] == 0
    assert other["out"]["token_ids"] == other["cold"]["token_ids"]
    assert (
        other["cold"]["token_ids"] != same["cold"]["token_ids"]
    )  # the new adapter answers otherwise
