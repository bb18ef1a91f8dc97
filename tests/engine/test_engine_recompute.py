"""Selective recompute inside a real vLLM engine (offline LLM, CPU backend; a tiny random Llama
and SmolLM2-135M; real text): the plugin hook reaches the loaded model, and the layer runner is
the model.

* the runner, recomputing every position over empty caches, reproduces the KV vLLM itself
  computed for the same prompt, at every layer;
* recomputing a subset over exact KV leaves the KV exact, and writes only the subset's slots
  (attended by vLLM's own CPU kernel, each run of consecutive positions as one of its requests);
* with ``recompute_policy="all"``, a donor whose KV was zeroed still yields vLLM's cold answer
  (tokens and logprobs), because every loaded token is recomputed through the model;
* a layer over a prefill's positions in chunks (vLLM's ``max_num_batched_tokens``) writes the
  same KV and gives the same output as all at once.
"""

import functools

import numpy as np
import pytest
import torch

from semshare_vllm.core.keys import DonorKey, donor_id_for
from semshare_vllm.recompute.layer_runner import LayerRunner
from semshare_vllm.recompute.policy import Selection
from semshare_vllm.testbed import models, offline
from semshare_vllm.testbed.text import wiki_document
from semshare_vllm.vllm_compat import cpu_attention, model_hook

pytestmark = pytest.mark.engine

MAX_TOKENS = 12
QUESTIONS = [
    "\n\nQuestion: What is the text above about? Answer:",
    "\n\nSummarize the passage above in one sentence:",
]
FILLER = "The quick brown fox jumps over the lazy dog. " * 8


@pytest.fixture(scope="module", params=["tiny-llama", "smollm2"])
def model(request):
    """A tiny random Llama (2 layers) and the real SmolLM2-135M (30 layers, GQA 9/3)."""
    return str(models.tiny_llama() if request.param == "tiny-llama" else models.smollm2())


@pytest.fixture(scope="module")
def cases(model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)

    def ids(text):
        return tok(text, add_special_tokens=False)["input_ids"]

    out = {}
    for i, name in enumerate(["kv", "poison"]):
        doc = ids(wiki_document(300 + 40 * i, 1500))
        out[name] = (doc + ids(QUESTIONS[0]), doc + ids(QUESTIONS[1]))
    out["filler"] = ids(FILLER)
    return out


@pytest.fixture(scope="module")
def reference(model, cases):
    prompt = cases["poison"][1]
    return offline.reference_outputs(model, [prompt], MAX_TOKENS)[0]


@pytest.fixture(scope="module")
def llm(model):
    # one engine per model param: the first must leave with its connector before the second
    engine = offline.semshare_llm(model, {"host_store_bytes": "512MiB", "recompute_policy": "all"})
    yield engine
    del engine
    offline.drop_connector()


@pytest.fixture
def worker(llm):
    return offline.connector_halves(llm)[1]


def run(llm, prompt):
    return offline.run(llm, prompt, MAX_TOKENS)


def captured(llm, worker, cases, prompt):
    """Run ``prompt``, wait for its capture; its donor key."""
    out = run(llm, prompt)
    key = DonorKey("", donor_id_for("", prompt + out["token_ids"][:-1]))
    run(llm, cases["filler"])  # one more step starts the capture...
    worker.flush_captures()  # ...which we wait for
    assert key in worker.kv.store
    return key


def donor_kv(worker, key, n):
    """[layers, 2, n, H, D] of a stored donor (the KV vLLM computed)."""
    pages = worker.kv.store.pool[:, worker.kv.store.blocks(key)]
    blocks = list(range(pages.shape[1]))
    return torch.stack([torch.stack(worker.kv.layout.read_range(p, blocks, 0, n)) for p in pages])


def private_caches(worker, num_blocks):
    """Empty paged caches shaped like the engine's, one per layer, named like its layers."""
    names = list(worker.geometry.layer_names)
    shape = (num_blocks, *worker.kv.caches[0].shape[1:])
    return {n: torch.zeros(shape, dtype=worker.kv.caches[0].dtype) for n in names}, names


def cache_kv(worker, caches, names, blocks, n):
    return torch.stack(
        [torch.stack(worker.kv.layout.read_range(caches[name], blocks, 0, n)) for name in names]
    )


def test_model_hook_reaches_the_loaded_model(llm, worker):
    assert any(name.endswith("CPUModelRunner") for name in model_hook.installed())
    assert isinstance(worker.kv.repairer.runner, LayerRunner)
    assert worker.kv.repairer.runner.model is model_hook.loaded_model(worker._vllm_config)
    assert type(worker.kv.repairer.runner.model).__name__ == "LlamaForCausalLM"
    assert len(worker.kv.repairer.runner.layers) in (2, 30)
    # layers over a prefill's positions go in vLLM's own chunks
    scheduler_config = worker._vllm_config.scheduler_config
    assert worker.kv.repairer.runner.chunk_tokens == scheduler_config.max_num_batched_tokens


def test_a_chunked_layer_reproduces_vllms_kv_and_the_unchunked_runners_output(llm, worker, cases):
    prompt, n, want, needed, blocks = _first_kv_case(llm, worker, cases)
    model = worker.kv.repairer.runner.model
    finals = []
    for chunk in (None, 64):
        caches, names = private_caches(worker, num_blocks=needed)
        runner = LayerRunner(model, caches, worker.kv.layout, chunk_tokens=chunk)
        calls: list[int] = []
        hook = runner.layers[0].decoder.module.register_forward_hook(
            functools.partial(_count_positions, calls)
        )
        try:
            result = runner.recompute(prompt, blocks, np.arange(n), final_hidden=True)
        finally:
            hook.remove()
        # layer 0 over every position: one call, or one per chunk of 64, in order
        assert calls == ([n] if chunk is None else [min(64, n - lo) for lo in range(0, n, 64)])
        got = cache_kv(worker, caches, names, blocks, n)
        torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-3)
        finals.append(result.hidden)
    torch.testing.assert_close(finals[1], finals[0], atol=1e-4, rtol=1e-4)


def _first_kv_case(llm, worker, cases):
    """The first "kv" prompt captured: (prompt, its length, vLLM's KV of it, how many blocks
    it needs, those blocks numbered from 0)."""
    prompt = cases["kv"][0]
    n = len(prompt)
    want = donor_kv(worker, captured(llm, worker, cases, prompt), n)
    needed = -(-n // worker.geometry.block_size)
    return prompt, n, want, needed, list(range(needed))


def _count_positions(calls, module, args, out=None):
    """A forward hook, or a pre-hook (no ``out``): how many positions the layer took."""
    calls.append(len(args[0]))


class _RecordingProbe(Selection):
    """Measures every position at layer 1 (deviation, the last tokens' attention), keeps every
    fourth from there, and holds what layer 1 measured."""

    window = 32

    def wants_probe(self, layer):
        return layer == 1, layer == 1

    def narrows_at(self, layer):
        return layer == 1

    def after_layer(self, probe):
        if probe.layer != 1:
            return None
        self.probe = probe
        return np.arange(0, len(probe.positions), 4)


def test_a_probe_in_chunks_measures_and_repairs_as_one_pass(llm, worker, cases):
    """The narrowing layer's probe (every position's K/V) runs in the runner's chunks, its last
    chunk holding the last tokens whose attention it sums: the same deviation, attention and
    repaired KV as one pass over every position."""
    prompt, n, want, needed, blocks = _first_kv_case(llm, worker, cases)
    model = worker.kv.repairer.runner.model
    garbled = np.sort(np.random.default_rng(2).choice(n, n // 3, replace=False))
    chunk = 48
    assert n > 2 * chunk, "the prompt must span several chunks"
    noise = torch.randn(
        (2, len(garbled), *want.shape[3:]), generator=torch.Generator().manual_seed(3)
    )
    seen = {}
    for size in (None, chunk):
        caches, names = private_caches(worker, num_blocks=needed)
        for layer, name in enumerate(names):  # vLLM's KV, a third of it garbled
            k, v = want[layer, 0].clone(), want[layer, 1].clone()
            k[garbled], v[garbled] = noise[0].to(k.dtype), noise[1].to(v.dtype)
            worker.kv.layout.write_range(caches[name], blocks, 0, k, v)
        runner = LayerRunner(model, caches, worker.kv.layout, chunk_tokens=size)
        calls: list[int] = []  # layer 1's calls, by how many positions each took
        hook = runner.layers[1].decoder.module.register_forward_pre_hook(
            functools.partial(_count_positions, calls)
        )
        selection = _RecordingProbe(np.arange(n))
        try:
            runner.recompute(prompt, blocks, selection)
        finally:
            hook.remove()
        seen[size] = (selection.probe, cache_kv(worker, caches, names, blocks, n), calls)
    (one, kv_one, calls_one), (chunked, kv_chunked, calls_chunked) = seen[None], seen[chunk]
    kept = len(range(0, n, 4))
    assert calls_one == [n, kept]  # the probe over every position, then the kept ones
    last = n % chunk if n % chunk >= _RecordingProbe.window else n % chunk + chunk
    assert calls_chunked == [chunk] * ((n - last) // chunk) + [last, kept]
    np.testing.assert_allclose(chunked.deviation, one.deviation, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(chunked.attention, one.attention, rtol=1e-4, atol=1e-6)
    assert one.deviation[garbled].min() > one.deviation[np.setdiff1d(np.arange(n), garbled)].max()
    # fp32 through 30 layers, the projections over other row counts: up to 4.9e-5 apart on an
    # AVX2-only CPU (within 1e-5 where it was written, a CPU with AVX-512 or AMX); the sibling
    # comparisons here allow 1e-4. A position repaired in one and not the other is O(1) off.
    torch.testing.assert_close(kv_chunked, kv_one, atol=1e-4, rtol=1e-4)


def test_runner_reproduces_vllms_kv_and_repairs_subsets_in_place(llm, worker, cases, monkeypatch):
    prompt = cases["kv"][0]
    n = len(prompt)
    want = donor_kv(worker, captured(llm, worker, cases, prompt), n)

    needed = -(-n // worker.geometry.block_size)
    caches, names = private_caches(worker, num_blocks=needed + 3)  # 3 blocks stay unused
    blocks = np.random.default_rng(0).permutation(needed + 3)[:needed].tolist()  # scattered
    runner = LayerRunner(worker.kv.repairer.runner.model, caches, worker.kv.layout)
    runner.recompute(prompt, blocks, np.arange(n))  # every position, over zeros
    got = cache_kv(worker, caches, names, blocks, n)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-3)

    # Garble a subset, recompute just it: exact again; no other slot of any block is written.
    subset = np.sort(np.random.default_rng(1).choice(n, n // 5, replace=False))
    for name in names:
        k, v = worker.kv.layout.read_range(caches[name], blocks, 0, n)
        k[subset], v[subset] = torch.randn_like(k[subset]), torch.randn_like(v[subset])
        worker.kv.layout.write_range(caches[name], blocks, 0, k, v)
    before = {name: c.clone() for name, c in caches.items()}
    runs = []  # the scattered subset is attended by vLLM's own CPU kernel, run by run
    kernel = cpu_attention.causal_attention

    def counted(cache, q, positions, *args):
        runs.append(1 + int(np.count_nonzero(np.diff(positions) != 1)))
        return kernel(cache, q, positions, *args)

    monkeypatch.setattr(cpu_attention, "causal_attention", counted)
    runner.recompute(prompt, blocks, subset, context=n)
    assert len(runs) == len(names) and min(runs) > 10
    torch.testing.assert_close(
        cache_kv(worker, caches, names, blocks, n), want, atol=2e-4, rtol=1e-3
    )
    untouched = np.setdiff1d(np.arange(n), subset)
    for name in names:
        k0, v0 = worker.kv.layout.read_range(before[name], blocks, 0, n)
        k1, v1 = worker.kv.layout.read_range(caches[name], blocks, 0, n)
        assert torch.equal(k0[untouched], k1[untouched]) and torch.equal(
            v0[untouched], v1[untouched]
        )
        unused = sorted(set(range(len(caches[name]))) - set(blocks))
        assert torch.equal(before[name][unused], caches[name][unused])


def test_recompute_all_over_a_zeroed_donor_equals_cold(llm, worker, cases, reference, monkeypatch):
    a, b = cases["poison"]
    key = captured(llm, worker, cases, a)
    worker.kv.store.pool[:, worker.kv.store.blocks(key)] = 0  # the donor's KV is now garbage
    recomputed = worker.stats.totals["recomputed_tokens"]
    # Watch every recompute: no block outside the loaded range of the request may change.
    seen = []
    original = worker.kv.repairer.runner.recompute

    def watched(token_ids, block_ids, selection, context=None, final_hidden=False, **kw):
        before = [c.clone() for c in worker.kv.caches]
        result = original(token_ids, block_ids, selection, context, final_hidden, **kw)
        first = int(selection.start()[0]) // worker.geometry.block_size
        mine = set(block_ids[first : -(-context // worker.geometry.block_size)])
        others = [i for i in range(len(worker.kv.caches[0])) if i not in mine]
        seen.append(
            all(torch.equal(x[others], y[others]) for x, y in zip(before, worker.kv.caches))
        )
        return result

    monkeypatch.setattr(worker.kv.repairer.runner, "recompute", watched)
    out = run(llm, b)
    assert seen == [True]
    assert out["num_cached_tokens"] > 0.8 * (len(b) - 20)
    assert worker.stats.totals["recomputed_tokens"] - recomputed == out["num_cached_tokens"]
    assert out["token_ids"] == reference["token_ids"]
    assert max(abs(x - y) for x, y in zip(out["logprobs"], reference["logprobs"])) < 1e-3


def longer_head_blend(worker, cases):
    """The "kv" case's document behind a longer head: its donor's KV blended into it on the
    engine's model (``testbed.blend_eval``); the bench and the target."""
    from semshare_vllm.testbed.blend_eval import BlendBench

    donor, target = cases["kv"]
    target = target[:40] + target  # another, longer head
    bench = BlendBench.on_engine(worker, donor, target)
    return bench, target


def test_blend_deviation_falls_to_zero_as_more_is_recomputed(llm, worker, cases):
    """Same document behind a different-length instruction: donor KV moved with RoPE
    correction, repaired by CacheBlend at ratio r. The last token's final hidden state and
    logits approach cold as r grows, and equal it at r = 100%."""
    from semshare_vllm.recompute.policy import CacheBlend, SemShareKV

    bench, target = longer_head_blend(worker, cases)
    assert bench.alignment.coverage > 0.8
    n = len(target)
    every = np.arange(n)
    always = np.union1d(bench.always(), [n - 1])
    # check at layer 0: with the tiny model's 2 layers, layer 1 is where r matters
    errors = [
        bench.evaluate(f"r={r}", CacheBlend(every, always, ratio=r, check_layer=0))
        for r in (0.0, 0.15, 0.5, 1.0)
    ]
    hidden = [o.hidden_error for o in errors]
    assert hidden[-1] < 1e-4 and errors[-1].logit_error < 1e-3 and errors[-1].same_top1
    assert all(a >= b - 1e-6 for a, b in zip(hidden, hidden[1:])), hidden
    assert hidden[0] > 10 * hidden[-1]

    # The check layer probes K/V of all, then runs attention and MLP for the kept only: the
    # same repair as running the check layer in full for everyone, at a fraction of the cost.
    class CheckLayerInFull(CacheBlend):
        def narrows_at(self, layer):
            return False

    probed = bench.evaluate("probe first", CacheBlend(every, always, 0.15, check_layer=0))
    probed_kv = {k: c.clone() for k, c in bench.caches.items()}
    full = bench.evaluate("in full", CheckLayerInFull(every, always, 0.15, check_layer=0))
    assert probed.recomputed == full.recomputed
    assert abs(probed.hidden_error - full.hidden_error) < 1e-4
    for k, c in bench.caches.items():
        torch.testing.assert_close(probed_kv[k], c, atol=1e-4, rtol=1e-4)
    # SemShareKV's schedule runs and recomputes less in deeper layers
    sem = bench.evaluate("semsharekv", SemShareKV(every, always))
    assert 0 < sem.recomputed < 1 and np.isfinite(sem.hidden_error)


def test_an_escalated_recompute_ends_as_the_wider_recompute(llm, worker, cases):
    """The adaptive gate's escalation: the runner goes back to the layer where the selection
    narrowed and runs the wider set from there, with the hidden states every position had
    there. With a bound of 0 the gate escalates to every position: the blend then ends exactly
    as cold (final hidden state, logits), as recomputing every position from the start does."""
    from semshare_vllm.recompute.policy import Adaptive, Fixed

    bench, target = longer_head_blend(worker, cases)
    n, layers = len(target), len(bench.runner.layers)
    every = np.arange(n)
    always = np.union1d(bench.always(), [n - 1])
    check, gate = (0, 1) if layers == 2 else (1, 8)
    sel = Adaptive(every, always, bound=0.0, check_layer=check, gate_layer=gate, max_share=0.1)
    escalated = bench.evaluate("escalated", sel)
    assert sel.escalations == 1 and sel.gate_residual > 0 and sel.residual == 0
    assert escalated.hidden_error < 1e-4 and escalated.logit_error < 1e-3
    full = bench.evaluate("all", Fixed(every))
    assert abs(escalated.hidden_error - full.hidden_error) < 1e-4
    # layers up to the gate ran twice for the positions of the first, narrow pass
    assert escalated.recomputed > 1.0 - 1e-9
    # a loose bound: no escalation, a narrow recompute that leaves an error
    loose = Adaptive(every, always, bound=10.0, check_layer=check, gate_layer=gate)
    narrow = bench.evaluate("loose", loose)
    assert loose.escalations == 0 and narrow.recomputed < 0.6
    assert narrow.hidden_error > escalated.hidden_error
