"""End to end on vLLM's offline LLM (in-process, CPU backend, tiny random Llama, real text).

Every claim is checked against vLLM's own cold computation of the same prompt, run in a fresh
process with no connector.
"""

import pytest
import torch

from semshare_vllm.core.keys import DonorKey, donor_id_for
from semshare_vllm.testbed import models, offline
from semshare_vllm.testbed.text import wiki_document

pytestmark = pytest.mark.engine

MAX_TOKENS = 12
QUESTIONS = [
    "\n\nQuestion: What is the text above about? Answer:",
    "\n\nSummarize the passage above in one sentence:",
]
FILLER = "The quick brown fox jumps over the lazy dog. " * 8


@pytest.fixture(scope="module")
def model():
    return str(models.tiny_llama())


@pytest.fixture(scope="module")
def cases(tok):
    """Per named case: prompt A (doc + question 1) and B (same doc + question 2), as token ids."""

    def ids(text):
        return tok(text, add_special_tokens=False)["input_ids"]

    out = {}
    for i, name in enumerate(["hit", "tenant", "poison", "corrupt", "hf"]):
        doc = ids(wiki_document(100 + 40 * i, 1500))
        out[name] = (doc + ids(QUESTIONS[0]), doc + ids(QUESTIONS[1]), len(doc))
    out["filler"] = ids(FILLER)
    return out


@pytest.fixture(scope="module")
def reference(model, cases):
    prompts = [c[1] for name, c in cases.items() if name != "filler"]
    results = offline.reference_outputs(model, prompts, MAX_TOKENS)
    return {tuple(p): r for p, r in zip(prompts, results)}


@pytest.fixture(scope="module")
def persist_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("donors")


@pytest.fixture(scope="module")
def llm(model, persist_dir):
    return offline.semshare_llm(
        model, {"persist_dir": str(persist_dir), "host_store_bytes": "512MiB"}
    )


@pytest.fixture
def sched(llm):
    return offline.connector_halves(llm)[0]


@pytest.fixture
def worker(llm):
    return offline.connector_halves(llm)[1]


def run(llm, prompt, salt=None):
    """Exact-prefix reuse only, as a client asks with ``{"semshare": "exact"}``: a donor is
    offered by its text from the step it is kept, and a target sharing most of it would
    otherwise be claimed whole by a semantic hit (on this random model; semantic hits are
    tested on SmolLM2 in test_engine_semantic*.py)."""
    return offline.run(llm, prompt, MAX_TOKENS, salt, kv_transfer_params={"semshare": "exact"})


def expected_claim(doc_len, prompt_len):
    bs = offline.BLOCK_SIZE
    return min(doc_len // bs * bs, (prompt_len - 1) // bs * bs)


def test_exact_prefix_hit_equals_cold(llm, sched, worker, cases, reference):
    a, b, doc_len = cases["hit"]
    assert len(worker.kv.stacks) == 1  # all layers in one buffer: block copies are one op each
    run(llm, a)
    hits, loaded = sched.stats.totals["hit_tokens"], worker.stats.totals["loaded_tokens"]
    copied = worker.stats.totals["block_copied_tokens"]
    out = run(llm, b)
    claimed = sched.stats.totals["hit_tokens"] - hits
    assert claimed == expected_claim(doc_len, len(b)) > 0.8 * doc_len
    assert worker.stats.totals["loaded_tokens"] - loaded == claimed
    # `a` finished one step before `b` arrived: its capture was still running, so `b` was served
    # from a's blocks (the host-store path is covered by the tenant test).
    assert worker.stats.totals["block_copied_tokens"] - copied == claimed
    assert out["num_cached_tokens"] == claimed
    ref = reference[tuple(b)]
    assert ref["num_cached_tokens"] == 0
    assert out["token_ids"] == ref["token_ids"]
    assert max(abs(x - y) for x, y in zip(out["logprobs"], ref["logprobs"])) < 1e-3


def test_tenants_never_share_donors(llm, sched, worker, cases, reference):
    a, b, doc_len = cases["tenant"]
    run(llm, a, salt="tenant-1")
    hits = sched.stats.totals["hit_tokens"]
    other = run(llm, b, salt="tenant-2")
    unsalted = run(llm, b)
    assert sched.stats.totals["hit_tokens"] == hits
    assert other["num_cached_tokens"] == unsalted["num_cached_tokens"] == 0
    assert other["token_ids"] == reference[tuple(b)]["token_ids"]
    worker.flush_captures()
    copied = worker.stats.totals["block_copied_tokens"]
    same = run(llm, b, salt="tenant-1")  # served from the host store
    assert worker.stats.totals["block_copied_tokens"] == copied
    assert same["num_cached_tokens"] == expected_claim(doc_len, len(b))
    assert same["token_ids"] == reference[tuple(b)]["token_ids"]


def donor_key(prompt, out, salt=""):
    """The donor a finished request leaves: its prompt and all but the last generated token."""
    return DonorKey(salt, donor_id_for(salt, prompt + out["token_ids"][:-1]))


def test_poisoned_donor_changes_output(llm, sched, worker, cases, reference):
    """Zeroing the stored donor must change the answer: the loaded KV is really attended to."""
    a, b, _ = cases["poison"]
    key = donor_key(a, run(llm, a))
    run(llm, cases["filler"])  # one more engine step: the capture of `a` starts...
    worker.flush_captures()  # ...and we wait for it
    assert key in sched.index and key in worker.kv.store
    worker.kv.store.pool[:, worker.kv.store.blocks(key)] = 0
    out = run(llm, b)
    assert out["num_cached_tokens"] > 0
    assert out["token_ids"] != reference[tuple(b)]["token_ids"]


def test_corrupt_persisted_donor_is_recomputed(llm, sched, worker, cases, reference):
    """A donor file corrupted on disk fails its checksum at load; vLLM recomputes, the request
    succeeds with the cold answer, and the donor is forgotten."""
    a, b, _ = cases["corrupt"]
    key = donor_key(a, run(llm, a))
    run(llm, cases["filler"])
    worker.flush_captures()
    worker.kv.store.flush()
    path = worker.kv.store._path(key)
    assert path.is_file()
    worker.kv.store.drop_memory(key)  # the next use must read the file
    raw = bytearray(path.read_bytes())
    raw[-4096:] = bytes(4096)  # same size, damaged data
    path.write_bytes(bytes(raw))
    failures = worker.stats.totals["load_failures"]
    out = run(llm, b)
    assert worker.stats.totals["load_failures"] == failures + 1
    assert out["token_ids"] == reference[tuple(b)]["token_ids"]
    assert key not in sched.index
    worker.kv.store.flush()
    assert not path.exists()


def test_captured_kv_equals_hf_keys_and_values(model, llm, worker, cases):
    """The KV read through our CPU_ATTN view is exactly the post-RoPE K and the V that
    Hugging Face computes for the same tokens (so K and V are not swapped or misplaced)."""
    from transformers import AutoModelForCausalLM

    a, _, _ = cases["hf"]
    key = donor_key(a, run(llm, a))
    run(llm, cases["filler"])
    worker.flush_captures()
    # [layers, blocks, H, N, 2D], CPU order
    pages = worker.kv.store.pool[:, worker.kv.store.blocks(key)]
    blocks = list(range(pages.shape[1]))
    stored = torch.stack(
        [torch.stack(worker.kv.layout.read_range(p, blocks, 0, len(a))) for p in pages]
    )  # [layers, 2, tokens, heads, dim]
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    with torch.no_grad():
        cache = hf(torch.tensor([a]), use_cache=True).past_key_values
    for layer in range(stored.shape[0]):
        k, v = cache.layers[layer].keys[0], cache.layers[layer].values[0]  # [heads, tokens, dim]
        torch.testing.assert_close(stored[layer, 0].transpose(0, 1), k, atol=2e-4, rtol=1e-3)
        torch.testing.assert_close(stored[layer, 1].transpose(0, 1), v, atol=2e-4, rtol=1e-3)
