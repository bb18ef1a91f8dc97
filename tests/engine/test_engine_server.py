"""End to end through a real `vllm serve` (OpenAI API on loopback), started and stopped by PID:
the README's quick start, tenant isolation over HTTP, and donors surviving a restart, with a
corrupt persisted donor skipped."""

import os
import re

import pytest
from support.thread_cores import connector_threads_off_the_compute_core

from semshare_vllm.store import donor_file
from semshare_vllm.testbed import models
from semshare_vllm.testbed.server import SEMSHARE, VllmServer
from semshare_vllm.testbed.text import wiki_document

pytestmark = pytest.mark.engine

Q1 = "\n\nQuestion: What is the text above about? Answer:"
Q2 = "\n\nSummarize the passage above in one sentence:"
DOCS = {name: wiki_document(start, 1500) for name, start in [("kept", 300), ("cut", 340)]}
ARGS = ["--block-size", "32", "--max-num-seqs", "4"]


@pytest.fixture(scope="module")
def model():
    return str(models.tiny_llama())


@pytest.fixture(scope="module")
def cold(model, tmp_path_factory):
    """Answers of vLLM itself, no connector."""
    log = tmp_path_factory.mktemp("logs") / "cold.log"
    with VllmServer(model, None, ARGS, log) as srv:
        return {name: srv.complete(doc + Q2).text for name, doc in DOCS.items()}


def semshare_server(model, persist_dir, log):
    cfg = dict(
        SEMSHARE,
        kv_connector_extra_config={"persist_dir": str(persist_dir), "host_store_bytes": "512MiB"},
    )
    return VllmServer(model, cfg, ARGS, log)


def wait_for_files(persist_dir, n, srv, timeout_s=60):
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        files = [f for f in persist_dir.glob("*/*.safetensors") if not f.name.startswith(".")]
        if len(files) >= n:
            return files
        srv.complete("ping " * 3, max_tokens=1)  # keep the engine stepping
        time.sleep(0.5)
    raise AssertionError(f"expected {n} persisted donors, found {files}")


def test_serve_hit_isolation_and_restart(model, cold, tmp_path):
    persist = tmp_path / "donors"
    with semshare_server(model, persist, tmp_path / "serve1.log") as srv:
        for doc in DOCS.values():
            first = srv.complete(doc + Q1)
            assert first.cached_tokens == 0
        hit = srv.complete(DOCS["kept"] + Q2)
        assert hit.cached_tokens >= 0.8 * hit.prompt_tokens
        assert hit.text == cold["kept"]
        other = srv.complete(DOCS["kept"] + Q2, cache_salt="another-tenant")
        assert other.cached_tokens == 0 and other.text == cold["kept"]
        metrics = srv.metrics()
        external = re.search(
            r"^vllm:external_prefix_cache_hits_total\{[^}]*\} (\S+)", metrics, re.M
        )
        assert external and float(external.group(1)) >= hit.cached_tokens
        files = wait_for_files(persist, 3, srv)  # kept, cut, and the hit request itself

    # Truncate every persisted donor of the "cut" document, then restart on the same directory.
    cut_title = DOCS["cut"].split("\n")[0]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    cut = [f for f in files if cut_title in tok.decode(donor_file.read_header(f).token_ids[:40])]
    assert cut
    for f in cut:
        f.write_bytes(f.read_bytes()[:-1000])

    with semshare_server(model, persist, tmp_path / "serve2.log") as srv:
        restored = srv.complete(DOCS["kept"] + Q2)
        assert restored.cached_tokens >= 0.8 * restored.prompt_tokens  # from disk, after restart
        assert restored.text == cold["kept"]
        skipped = srv.complete(DOCS["cut"] + Q2)
        assert skipped.cached_tokens == 0 and skipped.text == cold["cut"]
        assert "skipping persisted donor" in srv.log_text()
        # vLLM's start-up handshake: the worker loaded what this fingerprint names
        assert "1 worker(s) compute under this engine's fingerprint" in srv.log_text()


def test_serve_discovers_the_donor_behind_another_instruction(model, tmp_path, monkeypatch):
    """The same article behind another instruction, sent as a chat turn (no common prefix): the
    donor is found by the embedder, off the scheduler thread, in the request's own namespace
    only; the request itself is computed as usual (nothing exact to reuse)."""
    monkeypatch.setenv("VLLM_LOG_STATS_INTERVAL", "1")
    cfg = dict(
        SEMSHARE,
        kv_connector_extra_config={"host_store_bytes": "512MiB", "lookup_deadline_ms": 5000},
    )
    article = DOCS["kept"]
    with VllmServer(model, cfg, ARGS, tmp_path / "discovery.log") as srv:
        srv.complete(article + Q1)  # becomes the donor
        srv.wait_for_stat("donors_embedded", 1)
        # Through the chat API: the template wraps it, the embedder reads the detokenised ids.
        srv.chat("Read the article below, then do as asked.\n\n" + article + Q2)
        srv.wait_for_stat("semantic_found", 1)
        srv.chat(
            "Read the article below, then do as asked.\n\n" + article + Q2,
            cache_salt="another-tenant",
        )  # no donors there: no search
        srv.complete(wiki_document(5000, 1500) + Q2)  # unrelated: searched, none
        srv.wait_for_stat("semantic_misses", 1)
        stats = srv.connector_stats()
        cores = srv.thread_cores()
    assert stats["semantic_found"] == 1 and stats["semantic_misses"] == 1
    assert stats["semantic_lookups"] == 2
    assert "lookup_timeouts" not in stats and "discovery_faults" not in stats
    connector_threads_off_the_compute_core(cores)


def test_bad_config_stops_startup_naming_the_key(model, tmp_path):
    """No module path: the name resolves through our vllm.general_plugins entry point; the typo'd
    key then stops start-up with one error that names it."""
    cfg = {
        "kv_connector": "SemShareConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"host_store_byte": "1GiB"},
    }
    srv = VllmServer(model, cfg, ARGS, tmp_path / "bad.log")
    with pytest.raises(RuntimeError, match="exited"):
        srv.start(timeout_s=300)
    log = srv.log_text()
    assert "SemShareConfigError" in log
    assert "unknown key 'host_store_byte'" in log and "host_store_bytes" in log


def test_serve_reaches_the_model_and_recomputes(model, cold, tmp_path, monkeypatch):
    """In `vllm serve`'s own worker process, the plugin hook hands the loaded model to the
    connector: with recompute_policy "all", a hit's loaded tokens are recomputed through it
    (counted), and the answer is still vLLM's own."""
    monkeypatch.setenv("VLLM_LOG_STATS_INTERVAL", "1")
    cfg = dict(
        SEMSHARE,
        kv_connector_extra_config={"host_store_bytes": "512MiB", "recompute_policy": "all"},
    )
    with VllmServer(model, cfg, ARGS, tmp_path / "recompute.log") as srv:
        srv.complete(DOCS["kept"] + Q1)
        hit = srv.complete(DOCS["kept"] + Q2)
        assert hit.cached_tokens >= 0.8 * hit.prompt_tokens
        assert hit.text == cold["kept"]
        srv.wait_for_stat("recomputed_tokens", hit.cached_tokens)
        stats = srv.connector_stats()
        log = srv.log_text()
    assert stats["recomputed_tokens"] == hit.cached_tokens
    assert "recompute_failures" not in stats and "recompute_unavailable_tokens" not in stats
    assert "selective recompute is off" not in log


def _embeds_b64(seed: int, rows: int, hidden: int) -> str:
    import base64
    import io

    import torch

    g = torch.Generator().manual_seed(seed)
    buf = io.BytesIO()
    torch.save(torch.randn(rows, hidden, generator=g) * 0.02, buf)
    return base64.b64encode(buf.getvalue()).decode()


def test_prompt_embeddings_are_never_served_another_inputs_kv(model, tmp_path, monkeypatch):
    """``--enable-prompt-embeds``: such requests carry placeholder token ids, so two different
    embedding inputs of one length look like one prompt. They are neither served nor captured:
    each answer is the one computed with the connector opted out."""
    import json

    import requests

    monkeypatch.setenv("VLLM_LOG_STATS_INTERVAL", "1")
    hidden = json.loads((models.tiny_llama() / "config.json").read_text())["hidden_size"]
    cfg = dict(SEMSHARE, kv_connector_extra_config={"host_store_bytes": "256MiB"})
    with VllmServer(model, cfg, ARGS + ["--enable-prompt-embeds"], tmp_path / "embeds.log") as srv:

        def complete(seed, kv=None):
            body = {
                "model": srv.served_name,
                "prompt_embeds": _embeds_b64(seed, 320, hidden),
                "max_tokens": 8,
                "temperature": 0.0,
                "ignore_eos": True,
            }
            if kv is not None:
                body["kv_transfer_params"] = kv
            resp = requests.post(srv.url + "/v1/completions", json=body, timeout=300)
            resp.raise_for_status()
            out = resp.json()
            details = out["usage"].get("prompt_tokens_details") or {}
            return out["choices"][0]["text"], details.get("cached_tokens") or 0

        for first, second in ((1, 2), (3, 4)):
            complete(first)
            srv.complete("ping " * 3, max_tokens=1)  # a step: a captured donor is ready
            text, cached = complete(second)
            cold, _ = complete(second, kv={"semshare": "off"})
            assert cached == 0 and text == cold
        srv.wait_for_stat("unkeyable_requests", 4)
        stats = srv.connector_stats()
    assert "hits" not in stats and "donors_registered" not in stats


def test_fault_drill_sigkill_while_donors_are_persisted_then_restart(model, tmp_path, monkeypatch):
    """`vllm serve` with persist_dir is killed (SIGKILL, the whole process group) as soon as the
    first donor file lands, while other donors are being captured and written; beside what that
    leaves, a partial file of the killed writer is planted (its pid, half a donor's bytes), so the
    check does not depend on the kill landing mid-write. Restarted on the same directory, every
    donor it restores serves cold's answer, the partial file is removed and counted, and no
    request fails."""
    import shutil
    import signal
    import time
    from concurrent.futures import ThreadPoolExecutor

    from semshare_vllm.core import temp_files

    monkeypatch.setenv("VLLM_LOG_STATS_INTERVAL", "1")
    persist = tmp_path / "donors"
    docs = [wiki_document(6000 + 60 * i, 1500) for i in range(8)]
    srv = semshare_server(model, persist, tmp_path / "drill-killed.log").start()
    try:
        with ThreadPoolExecutor(4) as pool:
            for doc in docs:
                pool.submit(srv.complete, doc + Q1)
            deadline = time.monotonic() + 300
            while not list(persist.glob("*/*.tp0of1.safetensors")):
                assert time.monotonic() < deadline, "no donor was persisted"
                time.sleep(0.005)
            killed = srv.proc.pid
            os.killpg(os.getpgid(killed), signal.SIGKILL)
            srv.proc.wait(timeout=30)
    finally:
        srv.stop()
    landed = [f for f in persist.glob("*/*.tp0of1.safetensors")]
    root = landed[0].parent
    planted = root / f".tmp-{temp_files.writer_of(killed)}-drill.safetensors"
    planted.write_bytes(landed[0].read_bytes()[: landed[0].stat().st_size // 2])
    shutil.copy(planted, tmp_path / "planted-copy")

    with semshare_server(model, persist, tmp_path / "drill-restarted.log") as srv:
        for doc in docs:
            served = srv.complete(doc + Q2)
            cold = srv.complete(doc + Q2, kv_transfer_params={"semshare": "off"})
            assert served.text == cold.text, doc[:60]
        srv.wait_for_stat("persisted_incomplete", 1)
        stats = srv.connector_stats()
        log = srv.log_text()
    assert stats["donors_restored"] >= 1 and stats["hits"] >= 1
    assert stats["donors_restored"] + stats.get("persisted_skipped", 0) >= len(landed)
    assert not planted.exists()
    assert not [p for p in root.glob(f".tmp-{killed}.*")]
    assert "fallbacks" not in stats and "Traceback" not in log
