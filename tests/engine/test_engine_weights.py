"""Persisted donors are keyed by the weights that computed them: a new checkpoint written at the
same path (same file names, same sizes) restores none of the old donors, and the answer is the
new weights' cold answer. Each engine lifetime runs in its own process (``scenarios/``)."""

import os
import shutil
from pathlib import Path

import pytest
from support.lifetimes import lifetime as run_lifetime

from semshare_vllm.testbed import models, offline
from semshare_vllm.testbed.text import wiki_document

pytestmark = pytest.mark.engine

MAX_TOKENS = 8


def lifetime(model, persist_dir, tmp_path, **job):
    return run_lifetime(model, persist_dir, tmp_path, MAX_TOKENS, **job)


def rewrite_weights(model_dir: Path, keep_mtime: bool = False) -> None:
    """Other random weights, saved over the old file: same names, shapes and size.
    ``keep_mtime``: and the old mtime (a copy that normalises timestamps)."""
    import torch
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    old = path.stat()
    size = old.st_size
    tensors = load_file(str(path))
    g = torch.Generator().manual_seed(1)
    for name, t in tensors.items():
        if t.dim() == 2:
            tensors[name] = (torch.randn(t.shape, generator=g) * 0.08).to(t.dtype)
    save_file(tensors, str(path), metadata={"format": "pt"})
    assert path.stat().st_size == size
    if keep_mtime:
        os.utime(path, ns=(old.st_atime_ns, old.st_mtime_ns))


def model_and_prompts(tmp_path):
    """A copy of the tiny Llama to rewrite, two prompts on one document (the second served from
    the first's donor), and a filler prompt (the step that starts a capture)."""
    from transformers import AutoTokenizer

    model = tmp_path / "model"
    shutil.copytree(models.tiny_llama(), model)
    tok = AutoTokenizer.from_pretrained(str(model))

    def ids(text):
        return tok(text, add_special_tokens=False)["input_ids"]

    doc = ids(wiki_document(700, 900))
    a, b = doc + ids("\n\nQuestion: what is this about?"), doc + ids("\n\nSummarize it:")
    return model, a, b, ids("x " * 40)


# The isolating configuration (``offline.make_llm``: vLLM's prefix cache off, small blocks), and
# the one users run (vLLM's defaults: prefix caching on, the CPU build's 128-token blocks).
AS_USERS_RUN = {"enable_prefix_caching": True, "block_size": None}


# As users run, only with the old mtime kept: a new mtime is no case of its own (a rewrite moves
# the ctime either way, and a new ctime alone has the weights' digest read again, as the
# same-mtime case shows); it cost CI two minutes.
@pytest.mark.parametrize(
    "engine_args, keep_mtime",
    [({}, False), (AS_USERS_RUN, True)],
    ids=["isolating", "as-users-run-same-mtime"],
)
def test_donors_persisted_under_other_weights_are_not_restored(tmp_path, engine_args, keep_mtime):
    """Also when the new checkpoint keeps the old one's mtime: before, the weights were known by
    name, size and mtime, and that restart restored the old donors and served them."""
    model, a, b, filler = model_and_prompts(tmp_path)
    persist = tmp_path / "donors"

    def lifetime(*args, **job):
        return run_lifetime(*args, MAX_TOKENS, engine_args=engine_args, **job)

    first = lifetime(model, persist, tmp_path, prompt=a, capture=True, filler=filler)
    assert first["restored"] == 0 and first["worker"]["captured_donors"] >= 1
    ran_as = (first["prefix_caching"], first["block_size"])
    assert ran_as == ((True, 128) if engine_args else (False, offline.BLOCK_SIZE))
    same = lifetime(model, persist, tmp_path, prompt=b)  # control: same weights, restart
    assert same["restored"] >= 1 and same["scheduler"]["hit_tokens"] > 0
    assert same["fingerprint"] == first["fingerprint"]
    # the worker's fingerprint (of the identity taken as it loaded) is the scheduler's
    assert same["workers_confirmed"] == 1 and same["local_only"] == [None, None]

    rewrite_weights(model, keep_mtime)
    other = lifetime(model, persist, tmp_path, prompt=b)
    assert other["fingerprint"] != first["fingerprint"]
    assert other["restored"] == 0 and other["scheduler"].get("hit_tokens", 0) == 0
    cold = offline.reference_outputs(str(model), [b], MAX_TOKENS)[0]
    assert other["out"]["token_ids"] == cold["token_ids"]
    assert other["out"]["num_cached_tokens"] == 0


def test_a_checkpoint_replaced_while_the_engine_starts_lends_its_donors_no_other_name(tmp_path):
    """``vllm serve /ckpt/latest`` while a trainer points ``latest`` at the next checkpoint,
    after vLLM loaded the weights and before the connector is built. Before: the engine computed
    with step 1 and persisted its donors under step 2's fingerprint (read when the connector was
    built), and a restart on step 2 restored them and served step 1's KV as exact. Now the
    identity is the one taken as the model loaded: that engine keeps its donors to itself, and
    the restart restores nothing and answers as step 2 does cold."""
    step1, a, b, filler = model_and_prompts(tmp_path)
    step2 = tmp_path / "step2"
    shutil.copytree(step1, step2)
    rewrite_weights(step2)
    latest = tmp_path / "latest"
    latest.symlink_to(step1)
    persist = tmp_path / "donors"

    swapped = lifetime(
        latest,
        persist,
        tmp_path,
        prompt=a,
        capture=True,
        filler=filler,
        swap=[str(latest), str(step2)],
    )
    assert latest.resolve() == step2.resolve()  # the swap happened during its start-up
    assert swapped["worker"]["captured_donors"] >= 1  # kept in memory, as ever
    assert all(swapped["local_only"]) and "loaded them" in swapped["local_only"][1]
    assert not list(persist.rglob("*.safetensors"))
    restart = lifetime(latest, persist, tmp_path, prompt=b)
    assert restart["local_only"] == [None, None] and restart["restored"] == 0
    assert restart["scheduler"].get("hit_tokens", 0) == 0
    cold = offline.reference_outputs(str(step2), [b], MAX_TOKENS)[0]
    assert restart["out"]["token_ids"] == cold["token_ids"]


def test_donors_of_random_weights_are_never_persisted(tmp_path):
    """``load_format`` "dummy" (random weights, as a benchmark or profiling run starts) at the
    path of the real checkpoint: keyed by that path's files alone, its donors were restored by
    the next lifetime on the real weights and served as exact prefixes, 224 tokens, and its
    answer was not the real weights' cold answer (the reviewer's run on main). Now such an
    engine persists and shares nothing."""
    model, a, b, filler = model_and_prompts(tmp_path)
    persist = tmp_path / "donors"

    dummy = lifetime(
        model,
        persist,
        tmp_path,
        prompt=a,
        capture=True,
        filler=filler,
        engine_args={"load_format": "dummy"},
    )
    assert dummy["worker"]["captured_donors"] >= 1  # kept in memory, as ever
    assert not list(persist.rglob("*.safetensors"))  # never written
    real = lifetime(model, persist, tmp_path, prompt=b)
    assert real["fingerprint"] != dummy["fingerprint"]
    assert real["restored"] == 0 and real["scheduler"].get("hit_tokens", 0) == 0
    cold = offline.reference_outputs(str(model), [b], MAX_TOKENS)[0]
    assert real["out"]["token_ids"] == cold["token_ids"]


def persisting_engine(model, persist):
    """An in-process engine (as offline RL loops run it) over ``model``, persisting donors to
    ``persist``, prefix caching on; its connector halves, and ``gen(prompt, kv, salt)``: the
    greedy tokens of one request."""
    from semshare_vllm.testbed.offline import greedy, semshare_llm

    llm = semshare_llm(
        str(model),
        {"host_store_bytes": "64MiB", "persist_dir": str(persist), "lookup_deadline_ms": 20000},
        enable_prefix_caching=True,
    )
    sched, worker = offline.connector_halves(llm)

    def gen(prompt, kv=None, salt=None):
        request = {"prompt_token_ids": prompt}
        if salt is not None:
            request["cache_salt"] = salt
        params = greedy(MAX_TOKENS, logprobs=None, kv_transfer_params=kv)
        return list(llm.generate([request], params, use_tqdm=False)[0].outputs[0].token_ids)

    return llm, sched, worker, gen


def replace_weights(worker) -> None:
    """In the worker (``LLM.collective_rpc``): other random weights copied into the loaded
    model's matrices, in place, as a training loop's weight sync does between rollouts."""
    import torch

    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in worker.model_runner.model.parameters():
            if p.dim() == 2:
                p.copy_((torch.randn(p.shape, generator=g) * 0.08).to(p.dtype))


def test_a_pause_drops_the_donors_of_the_weights_before_it(tmp_path):
    """Reinforcement-learning loops pause an engine (vLLM's ``pause_scheduler`` with
    ``clear_cache``, which its ``sleep`` calls too), sync new weights into it, and resume. The
    pause resets vLLM's prefix cache and the connector's (``reset_connector=True``).

    On main: the connector ignored the reset, and b was served 224 tokens of a's donor (old
    weights) over the new weights: 8 tokens that were not the new weights' cold ones. And an
    in-process engine paused right after ``generate`` (its last request's blocks held for our
    capture) raised in vLLM's reset. Now the pause succeeds, nothing of before is served, the
    answer is the new weights' cold one (prefix caching on), and nothing is persisted after."""
    model, a, b, filler = model_and_prompts(tmp_path)
    persist = tmp_path / "donors"
    llm, sched, worker, gen = persisting_engine(model, persist)
    engine = llm.llm_engine.engine_core.engine_core  # in-process, as offline RL loops run it

    try:
        gen(a)
        gen(filler, kv={"semshare": "off"})  # the step that captures a
        worker.flush_captures()
        worker.kv.store.flush()  # the disk writer's queue too
        assert list(persist.rglob("*.safetensors"))  # a, persisted
        gen(filler)  # kept as a donor: its blocks are held for the capture when it returns
        assert sched.has_pending_block_frees()

        engine.pause_scheduler(mode="abort", clear_cache=True)
        llm.collective_rpc(replace_weights)
        engine.resume_scheduler()
        assert sched.stats.totals["connector_resets"] == 1
        hits = sched.stats.totals.get("hit_tokens", 0)
        served = gen(b)
        assert sched.stats.totals.get("hit_tokens", 0) == hits  # nothing of before served
        cold = gen(b, kv={"semshare": "off"}, salt="cold")  # the new weights' own answer
        assert served == cold
        # b itself is kept, for this process only: served again, never persisted
        gen(filler, kv={"semshare": "off"})
        worker.flush_captures()
        assert llm.reset_prefix_cache()  # vLLM's copy of b gone: only ours is left
        assert gen(b) == cold and sched.stats.totals.get("hit_tokens", 0) > hits
        worker.kv.store.flush()  # its queued deletes done
        assert not list(persist.rglob("*.safetensors"))  # a's file went with the reset
    finally:
        offline.drop_connector()  # vLLM keeps the worker half in a global


def load_checkpoint(worker, path: str) -> None:
    """In the worker (``LLM.collective_rpc``): a checkpoint's tensors through the model's own
    ``load_weights``, as TRL's, OpenRLHF's and verl's weight syncs and vLLM's own weight
    transfer engines load them. The embeddings only: vLLM's CPU build repacks the linear
    layers' weights at load, which ``load_weights`` then cannot write (``reload_weights``
    can)."""
    from safetensors.torch import load_file

    tensors = load_file(path)
    worker.model_runner.model.load_weights(
        (name, t) for name, t in tensors.items() if "embed_tokens" in name
    )


@pytest.mark.parametrize("update", ["load_weights", "reload_weights"])
def test_weights_updated_through_vllm_drop_the_donors_of_before(tmp_path, update):
    """A training loop's weight sync with no connector reset: new weights through the model's
    ``load_weights`` (TRL's, OpenRLHF's, verl's syncs) or vLLM's ``reload_weights`` (from the
    checkpoint rewritten on disk), then ``reset_prefix_cache()`` alone, as TRL calls it, which
    resets vLLM's cache and not the connector's.

    On main b was served from a's donor, computed with the old weights, and its answer was not
    the new weights' cold answer. Now the worker sees the update, drops every donor of before
    and tells the scheduler, which forgets them as a connector reset does."""
    model, a, b, filler = model_and_prompts(tmp_path)
    new = tmp_path / "new"
    shutil.copytree(model, new)
    rewrite_weights(new)
    persist = tmp_path / "donors"
    llm, sched, worker, gen = persisting_engine(model, persist)

    try:
        old = gen(b, kv={"semshare": "off"}, salt="old")  # the old weights' answer
        gen(a)
        gen(filler, kv={"semshare": "off"})  # the step that captures a
        worker.flush_captures()
        worker.kv.store.flush()  # the disk writer's queue too
        assert list(persist.rglob("*.safetensors"))  # a, persisted

        if update == "load_weights":
            llm.collective_rpc(load_checkpoint, args=(str(new / "model.safetensors"),))
        else:
            shutil.copy(new / "model.safetensors", model / "model.safetensors")
            llm.collective_rpc("reload_weights")
        assert llm.reset_prefix_cache()  # vLLM's cache only, as TRL resets it
        loaded = worker.stats.totals.get("loaded_tokens", 0)
        served = gen(b)
        cold = gen(b, kv={"semshare": "off"}, salt="cold")  # the new weights' own answer
        assert cold != old  # the weights did change
        assert served == cold
        # b's claim, made before the scheduler heard of the update, failed: nothing loaded
        assert worker.stats.totals.get("loaded_tokens", 0) == loaded
        assert worker.stats.totals["weight_updates"] == 1
        assert sched.stats.totals["connector_resets"] == 1
        assert sched.geometry.local_only
        worker.kv.store.flush()  # the deletes, on the store's disk thread
        assert not list(persist.rglob("*.safetensors"))  # a's file gone too
        # b was live when the scheduler heard (no donor); once more, it is kept, for this
        # process only, and serves
        assert gen(b) == cold
        gen(filler, kv={"semshare": "off"})
        worker.flush_captures()
        assert llm.reset_prefix_cache()
        assert gen(b) == cold and worker.stats.totals.get("loaded_tokens", 0) > loaded
        worker.kv.store.flush()  # its queued deletes done
        assert not list(persist.rglob("*.safetensors"))
    finally:
        offline.drop_connector()


@pytest.mark.parametrize("plugins", ["loaded", "none"])
def test_serve_a_weight_reload_over_http_drops_the_donors_of_before(tmp_path, plugins, monkeypatch):
    """The same through a real ``vllm serve`` (engine core and worker in their own processes,
    prefix caching on): vLLM's ``reload_weights`` over its development RPC endpoint, after the
    checkpoint was rewritten on disk, then ``/reset_prefix_cache`` alone. The worker process
    sees the update; b's answer is the new weights' cold answer. Also where vLLM loads none of
    our plugins (``VLLM_PLUGINS``; the connector comes by its module path): the reviewer's run
    on the first version served a's donor there, as the watch was installed by the plugin
    only."""
    import time

    import requests

    if plugins == "none":
        monkeypatch.setenv("VLLM_PLUGINS", "none")

    from semshare_vllm.testbed.server import SEMSHARE, VllmServer
    from semshare_vllm.testbed.text import wiki_document

    model, _, _, _ = model_and_prompts(tmp_path)
    new = tmp_path / "new"
    shutil.copytree(model, new)
    rewrite_weights(new)
    persist = tmp_path / "donors"
    cfg = dict(
        SEMSHARE,
        kv_connector_extra_config={"persist_dir": str(persist), "host_store_bytes": "256MiB"},
    )
    doc = wiki_document(300, 1500)
    a, b = doc + "\n\nQuestion: What is the text above about? Answer:", doc + "\n\nSummarize it:"
    args = ["--block-size", "32", "--max-num-seqs", "4"]
    off = {"semshare": "off"}
    with VllmServer(
        model, cfg, args, tmp_path / "serve.log", prefix_caching=True, dev_mode=True
    ) as srv:
        old = srv.complete(b, MAX_TOKENS, cache_salt="old", kv_transfer_params=off).text
        srv.complete(a, MAX_TOKENS)
        srv.complete("ping " * 3, 1, kv_transfer_params=off)  # the step that captures a
        srv.reset_prefix_cache()  # vLLM's copy of a gone: b is served from our donor
        assert srv.complete(b, MAX_TOKENS).cached_tokens > 0  # (b itself is no donor: approximate)
        # a persisted with our plugin; never without (a sync through the model's load_weights
        # would go unseen, and leave donors of other weights on disk)
        deadline = time.monotonic() + (30 if plugins == "loaded" else 0)
        while not list(persist.rglob("*.safetensors")) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert bool(list(persist.rglob("*.safetensors"))) == (plugins == "loaded")
        srv.reset_prefix_cache()
        shutil.copy(new / "model.safetensors", model / "model.safetensors")
        resp = requests.post(
            srv.url + "/collective_rpc", json={"method": "reload_weights"}, timeout=120
        )
        resp.raise_for_status()
        srv.reset_prefix_cache()  # vLLM's cache only, as TRL resets it
        served = srv.complete(b, MAX_TOKENS).text
        cold = srv.complete(b, MAX_TOKENS, cache_salt="cold", kv_transfer_params=off).text
        assert cold != old  # the weights did change
        assert served == cold
        assert "the model's weights were updated" in srv.log_text()
    if plugins == "none":  # its load_weights unseen: donors never left the process
        assert "VLLM_PLUGINS leaves out the 'semshare' plugin" in srv.log_text()
