"""`semshare-bench`: workloads from real text, the workload file, clear failures, and a short
run of every workload against a real `vllm serve` with the connector (--launch)."""

import http.server
import json
import subprocess
import sys
import threading

import pytest

from semshare_vllm.bench import cli
from semshare_vllm.bench import workloads as W
from semshare_vllm.bench.client import Endpoint
from semshare_vllm.testbed.models import smollm2_tokenizer


@pytest.fixture(scope="module")
def sizer():
    return W.Sizer(smollm2_tokenizer())


@pytest.mark.parametrize("name", W.WORKLOADS)
def test_workloads_are_real_text_sized_and_seeded(sizer, name):
    reqs = W.build(name, 2, 512, sizer, seed=3)
    assert reqs == W.build(name, 2, 512, sizer, seed=3)  # the seed fixes them
    assert reqs != W.build(name, 2, 512, sizer, seed=4) or name == "doc-qa"
    groups = {r.group for r in reqs}
    assert len(groups) == 2 and all(r.workload == name for r in reqs)
    targets = [r for r in reqs if r.role == "target"]
    donors = [r for r in reqs if r.role == "donor"]
    assert targets and all(len(r.prompt) > 100 for r in reqs)
    if name == "negative":
        assert not donors
    else:  # each group: its donor first, then its targets
        assert len(donors) == 2 and all(
            [r.role for r in reqs if r.group == g][0] == "donor" for g in groups
        )
    if name in ("cross-instruction", "negative", "edit", "multi-turn"):
        assert all(sizer.count(r.prompt) < 512 + 120 for r in donors or reqs)
    if name == "doc-qa":
        assert all(r.answer and r.answer in r.prompt for r in reqs)
    if name == "edit":
        assert sorted({r.level for r in targets}) == list(W.EDIT_LEVELS)
    # held-out references: text the prompt should make likely, never in the prompt itself
    if name in ("cross-instruction", "negative", "edit"):
        assert all(
            30 <= sizer.count(r.reference) <= W.REFERENCE_TOKENS + 2 and r.reference not in r.prompt
            for r in targets
        )
    if name == "doc-qa":  # the answer, then the sentence of the prompt that states it
        assert all(r.reference.startswith(f" {r.answer}. ") for r in targets)
        assert all(r.reference[len(r.answer) + 3 :] in r.prompt for r in targets)
        assert all(sizer.count(r.reference) >= 15 for r in targets)
    if name == "multi-turn":
        assert (
            sum(r.reference is not None and r.reference not in r.prompt for r in targets)
            >= len(targets) - 1
        )
    if name == "rag-reorder":
        assert all(r.reference is None for r in reqs)


@pytest.mark.parametrize("name", ["rag-reorder", "cross-instruction", "doc-qa"])
def test_workloads_near_the_models_context_are_built_to_fit_it(sizer, name):
    """At 8K, SmolLM2's whole context, rag-reorder's prompts came out ~8,680 tokens: built
    smaller, every prompt (with its scored reference) fits the server's context less the
    output; where it already fits, the size is kept."""
    limit = 8192 - 32
    reqs, size = W.build_within(name, 1, 8192, sizer, 0, limit)
    assert max(sizer.count(r.prompt + (r.reference or "")) for r in reqs) <= limit
    assert size < 8192 and size > 7000
    assert W.build_within(name, 1, 1024, sizer, 0, limit) == (W.build(name, 1, 1024, sizer), 1024)
    with pytest.raises(W.WorkloadError, match="does not fit"):
        W.build_within(name, 1, 1024, sizer, 0, 50)


def test_the_endpoint_reads_the_context_the_server_serves():
    srv = http.server.HTTPServer(("127.0.0.1", 0), _PlainVllm)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        endpoint = Endpoint(f"http://127.0.0.1:{srv.server_port}")
        endpoint.check(need_connector=False)
    finally:
        srv.shutdown()
    assert (endpoint.model, endpoint.max_model_len) == ("m", 8192)


def test_workload_file_errors_name_the_line(tmp_path):
    good = tmp_path / "w.jsonl"
    good.write_text(
        '{"prompt": "a donor text", "group": "g", "role": "donor"}\n\n'
        '{"prompt": "a target text", "group": "g", "answer": "x", "reference": " y"}\n'
    )
    reqs = W.load_file(good)
    assert [(r.group, r.role, r.answer, r.reference) for r in reqs] == [
        ("g", "donor", None, None),
        ("g", "target", "x", " y"),
    ]
    for line, why in [
        ('{"group": "g"}', "missing 'prompt'"),
        ('{"prompt": "p", "role": "teacher"}', "'role' must be"),
        ("not json", "line 2"),
        ('["a list"]', "not a JSON object"),
        ('{"prompt": "p", "reference": 3}', "'reference' must be"),
    ]:
        bad = tmp_path / "bad.jsonl"
        bad.write_text('{"prompt": "fine"}\n' + line + "\n")
        with pytest.raises(W.WorkloadError, match="line 2"):
            W.load_file(bad)
        with pytest.raises(W.WorkloadError, match=why):
            W.load_file(bad)
    with pytest.raises(W.WorkloadError, match="unknown workload"):
        W.build("nope", 1, 512, W.Sizer())


def test_cli_fails_clearly(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--base-url", "http://127.0.0.1:9", "--workloads", "nope"])
    assert e.value.code == 2 and "unknown workload" in capsys.readouterr().err
    assert cli.main(["--base-url", "http://127.0.0.1:9"]) == 2
    assert "no vLLM server at http://127.0.0.1:9" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x"}\n{"role": "donor"}\n')
    assert cli.main(["--base-url", "http://127.0.0.1:9", "--workload-file", str(bad)]) == 2
    assert "line 2" in capsys.readouterr().err


class _PlainVllm(http.server.BaseHTTPRequestHandler):
    """Answers like a vLLM server without the connector: a model, metrics without ours."""

    def do_GET(self):
        body = (
            json.dumps({"data": [{"id": "m", "max_model_len": 8192}]})
            if self.path == "/v1/models"
            else 'vllm:num_requests_running{model_name="m"} 0.0\n'
        ).encode()
        self.send_response(200)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_a_server_without_the_connector_is_refused(capsys):
    srv = http.server.HTTPServer(("127.0.0.1", 0), _PlainVllm)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        assert cli.main(["--base-url", f"http://127.0.0.1:{srv.server_port}/v1"]) == 2
    finally:
        srv.shutdown()
    assert "does not run the SemShare connector" in capsys.readouterr().err


class RecordingEndpoint:
    """Answers like a server whose cold completions of the target are all the same text, except
    one that ran beside another request; records each request and when it ran."""

    def __init__(self):
        self.calls, self.lookups = [], 0  # [prompt, salt, kv_transfer_params, start, end]

    def counters(self):
        self.lookups += 1
        return {"lookups": self.lookups, "hit_tokens": 0}

    def complete(self, prompt, max_tokens=16, cache_salt=None, kv_transfer_params=None):
        import time

        from semshare_vllm.bench.client import Completion

        call = [prompt, cache_salt, kv_transfer_params, time.monotonic(), None]
        self.calls.append(call)
        time.sleep(0.1 if prompt == "P" else 0.3)  # the other request outlasts the target
        call[4] = time.monotonic()
        text = "the answer varies here" if self.beside(call) else "the answer is here"
        return Completion(text, 0.01, 0.02, 0, 10)

    def beside(self, call):
        """Whether another request ran at some time during ``call``."""
        return any(
            other is not call and other[3] < call[4] and (other[4] is None or call[3] < other[4])
            for other in self.calls
        )


def test_the_noise_floor_is_the_target_cold_again_beside_another_request():
    from semshare_vllm.bench import report
    from semshare_vllm.bench.measure import OPT_OUT, measure_target
    from semshare_vllm.bench.workloads import BenchRequest

    endpoint = RecordingEndpoint()
    request = BenchRequest(prompt="P", group="g", role="target", workload="w")
    m = measure_target(endpoint, request, 4, cold_first=True, perplexity=False)
    colds = [c for c in endpoint.calls if c[0] == "P" and c[2] == OPT_OUT]
    assert len(colds) == 2 and colds[0][1] != colds[1][1]  # each cold its own salt
    assert not endpoint.beside(colds[0]) and endpoint.beside(colds[1])
    assert m.noise.text == "the answer varies here"
    summary = report.summarize([m])["w"]
    assert summary["rouge_l_noise_floor"] == pytest.approx(0.75)
    assert "| 0.75 |" in report.table({512: {"w": summary}})
    skipped = measure_target(
        endpoint, request, 4, cold_first=True, perplexity=False, noise_floor=False
    )
    assert skipped.noise is None
    assert report.summarize([skipped])["w"]["rouge_l_noise_floor"] is None


@pytest.mark.engine
def test_every_workload_against_a_launched_server(tmp_path, monkeypatch, capsys):
    out, plots = tmp_path / "r.json", tmp_path / "plots"
    rc = cli.main(
        [
            "--launch",
            "--workloads",
            "all",
            "--context-tokens",
            "512",
            "--groups",
            "1",
            "--max-tokens",
            "8",
            "--out",
            str(out),
            "--plots",
            str(plots),
            # one target per workload: a loaded machine must not turn it into a miss
            "--extra-config",
            json.dumps({"lookup_deadline_ms": 20000}),
        ]
    )
    printed = capsys.readouterr().out
    assert rc == 0, printed
    result = json.loads(out.read_text())
    assert result["complete"] and result["config"]["context_tokens"] == [512]
    by = result["results"]["512"]["workloads"]
    rows = result["results"]["512"]["requests"]
    assert set(by) == set(W.WORKLOADS)
    # as users run vLLM (prefix caching on, its default block size): the next turn of a chat
    # is served by vLLM's own cache, the other workloads share no prefix with their donors
    served_as = {"block_size": "128", "enable_prefix_caching": "True"}
    assert result["config"]["server_cache"] == served_as
    assert by["multi-turn"]["vllm_cache_rate"] > 0, by["multi-turn"]
    for name in ("cross-instruction", "rag-reorder", "doc-qa"):
        assert by[name]["hits"] >= 1, (name, by[name])
        assert by[name]["semshare_hits"]["median_ttft_ms"] > 0
        assert by[name]["cold"]["median_ttft_ms"] > 0 and by[name]["hit_only_speedup"] > 0
    assert by["negative"]["hits"] == 0 and by["negative"]["miss_overhead"] is not None
    assert by["doc-qa"]["accuracy_cold"] is not None
    assert by["rag-qa"]["accuracy_cold"] is not None
    # entity-swap: donor values counted over the targets cold got right, only there
    swap = by["entity-swap"]
    assert 0 <= swap["donor_value_answers"] <= swap["donor_value_cold_right"] <= swap["targets"]
    assert all(s["donor_value_answers"] is None for n, s in by.items() if n != "entity-swap")
    # references scored after hits: vLLM's prompt logprobs, the connector serving the prompt
    for name in ("cross-instruction", "doc-qa"):
        assert 0.5 < by[name]["perplexity_ratio_hits"] < 2.0, (name, by[name])
        assert 0.5 < by[name]["perplexity_ratio_pooled_hits"] < 2.0, (name, by[name])
        # each hit's decode steps (8 tokens each): what vLLM's forward of one token costs
        assert 0 < by[name]["breakdown_hits_ms"]["tpot"] < by[name]["cold"]["median_ttft_ms"]
    assert all(r["reference_tokens"] > 0 for r in rows if r["reference_nll_cold"] is not None)
    # a hit's reference is scored on the claim its served request got: the scoring request
    # (prompt + reference, reuse limit at the prompt's end) claims what the served request
    # reused, vLLM's prefix cache and the connector together (with prompt logprobs vLLM reads
    # none of its cache: seen where a target shares its first blocks with its donor). Hits
    # that escalated are left out: their escalation may have demoted the donor (the second
    # target to escalate on it), and the scoring request then finds none.
    scored_hits = [
        r
        for r in rows
        if r["hit"] and r["reference_nll_semshare"] is not None and not r["escalated"]
    ]
    assert scored_hits
    assert all(r["reference_connector_tokens"] == r["cached_tokens"] for r in scored_hits), [
        (r["workload"], r["cached_tokens"], r["connector_tokens"], r["reference_connector_tokens"])
        for r in scored_hits
    ]
    assert by["rag-reorder"]["perplexity_ratio_hits"] is None
    assert set(by["edit"]["by_edit_level"]) == {f"{x:.1f}" for x in W.EDIT_LEVELS}
    assert all(r["cold_output"] and r["semshare_output"] and r["noise_output"] for r in rows)
    assert all(0.0 <= s["rouge_l_noise_floor"] <= 1.0 for s in by.values())
    assert "| 512 | cross-instruction |" in printed and "| 512 | entity-swap |" in printed
    assert (plots / "ttft_vs_context.png").stat().st_size > 1000
    assert (plots / "ttft_by_workload_512.png").stat().st_size > 1000
    assert (plots / "fidelity_vs_edit.png").stat().st_size > 1000
    # the repair each workload's hits got (the default adaptive policy)
    assert 0 < by["cross-instruction"]["recompute_share_hits"] <= 2.0
    assert 0 <= by["cross-instruction"]["escalation_rate_hits"] <= 1
    # and the hits against issue 21's ceiling for that share (30 layers reported per hit)
    assert len(by["cross-instruction"]["recompute_layers_hits_ms"]) == 30
    assert (
        by["cross-instruction"]["ceiling_hits"] > 1
        and by["cross-instruction"]["of_ceiling_hits"] > 0
    )


def test_a_group_sends_its_donor_then_measures_its_targets(monkeypatch):
    """``measure.run`` over one group: the donor first (through the connector), then the
    target cold and served; the donor's capture is waited for."""
    from semshare_vllm.bench import measure
    from semshare_vllm.bench.workloads import BenchRequest

    waited = []
    monkeypatch.setattr(measure, "wait_for_donors", lambda e, b, n, s: waited.append(n))
    endpoint = RecordingEndpoint()
    group = [
        BenchRequest(prompt="D", group="g", role="donor", workload="w"),
        BenchRequest(prompt="P", group="g", role="target", workload="w"),
    ]
    results = measure.run(endpoint, group, 4, noise_floor=False, perplexity=False)
    assert [c[0] for c in endpoint.calls][:1] == ["D"] and waited == [1]
    assert len(results) == 1 and results[0].request.prompt == "P"


_TERMINATED_SCRIPT = """
import os, signal, sys
from pathlib import Path
from semshare_vllm.bench import cli
from semshare_vllm.testbed import server

marker = Path(sys.argv[1])

class Server:  # stands in for vllm serve: what matters is whether stop() runs
    def __init__(self, *args, **kwargs):
        self.url, self.served_name = "http://127.0.0.1:9", "model"
    def __enter__(self):
        return self
    def __exit__(self, *exc):
        marker.write_text("stopped")

class Endpoint:
    def __init__(self, *args):
        pass
    def check(self):
        pass

def bench(*args):  # the bench is running when something (a CI harness, kill) terminates it
    os.kill(os.getpid(), signal.SIGTERM)
    return 0

server.VllmServer, cli.Endpoint, cli.bench, cli._sizer = Server, Endpoint, bench, lambda t: None
sys.exit(cli.main(["--launch", "--model", "m"]))
"""


def test_a_terminated_launched_bench_stops_its_server(tmp_path):
    """``--launch`` starts ``vllm serve`` in its own session (so a Ctrl-C meant for the bench
    does not reach it first): a SIGTERM to the bench must still stop it, not leave a server
    holding the machine's cores and memory (seen: a killed bench left its server running)."""
    marker = tmp_path / "marker"
    done = subprocess.run(
        [sys.executable, "-c", _TERMINATED_SCRIPT, str(marker)], capture_output=True, timeout=120
    )
    assert marker.exists(), (done.returncode, done.stderr.decode()[-2000:])
    assert done.returncode != 0  # it still ends as terminated


class _ServingEndpoint:
    """A server with the connector that serves ``max_model_len`` tokens; records requests."""

    max_model_len, model, url = 1024, "m", "http://127.0.0.1:9"

    def __init__(self, *args):
        self.sent = []

    def cache_config(self):
        return {}

    def check(self, need_connector=True):
        pass

    def counters(self):
        return {}

    def complete(self, prompt, *args, **kwargs):
        self.sent.append(prompt)
        raise AssertionError("nothing may be sent for a workload that cannot fit")


def test_a_workload_file_prompt_longer_than_the_server_serves_is_named(
    tmp_path, monkeypatch, capsys
):
    """Seen: a file of 8K prompts against a server sized for 4K failed on every request with
    a bare HTTP 400 traceback. Now the prompt that does not fit is named before anything is
    sent."""
    f = tmp_path / "long.jsonl"
    f.write_text(
        json.dumps({"prompt": "short", "group": "g", "role": "donor"})
        + "\n"
        + json.dumps({"prompt": "word " * 1500, "group": "g"})
        + "\n"
    )
    endpoint = _ServingEndpoint()
    monkeypatch.setattr(cli, "Endpoint", lambda *a: endpoint)
    monkeypatch.setattr(cli, "_sizer", lambda tokenizer: W.Sizer())
    assert cli.main(["--base-url", "http://127.0.0.1:9", "--workload-file", str(f)]) == 2
    err = capsys.readouterr().err
    assert "group 'g'" in err and "1875 tokens" in err and "992" in err, err
    assert endpoint.sent == []


def _launched_with(monkeypatch, tmp_path, *argv) -> dict:
    """What ``--launch`` would start ``vllm serve`` with (the server stood in for)."""
    started = {}

    class Server:
        url, served_name = "http://127.0.0.1:9", "m"

        def __init__(self, model, kv, args, log, max_model_len, prefix_caching):
            started.update(args=args, prefix_caching=prefix_caching, max_model_len=max_model_len)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

    from semshare_vllm.testbed import server

    monkeypatch.setattr(server, "VllmServer", Server)
    monkeypatch.setattr(cli, "Endpoint", _ServingEndpoint)
    monkeypatch.setattr(cli, "bench", lambda *a: 0)
    monkeypatch.setattr(cli, "_sizer", lambda tokenizer: W.Sizer())
    assert cli.main(["--launch", "--model", str(tmp_path), *argv]) == 0
    return started


def test_launch_sizes_its_server_for_the_workload_files_longest_prompt(tmp_path, monkeypatch):
    f = tmp_path / "long.jsonl"
    f.write_text(json.dumps({"prompt": "word " * 4000, "group": "g"}) + "\n")  # 5,000 tokens
    started = _launched_with(monkeypatch, tmp_path, "--workload-file", str(f))
    assert started["max_model_len"] >= 5000 + 32


def test_launch_serves_as_users_run_vllm(tmp_path, monkeypatch):
    """Seen: every ``--launch`` figure came from a server with prefix caching off and block
    size 32, not the configuration users run. Now vLLM's defaults, unless asked otherwise."""
    started = _launched_with(monkeypatch, tmp_path)
    assert started["args"] == [] and started["prefix_caching"] is True
    isolated = _launched_with(
        monkeypatch, tmp_path, "--server-args", "--block-size 32 --no-enable-prefix-caching"
    )
    assert isolated["args"] == ["--block-size", "32", "--no-enable-prefix-caching"]


def test_the_endpoint_names_the_servers_cache_configuration(monkeypatch):
    from semshare_vllm.bench import client

    text = "\n".join(
        [
            "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
            'vllm:cache_config_info{block_size="128",cache_dtype="auto",'
            'enable_prefix_caching="True",engine="0"} 1.0',
            'vllm:semshare_hits_total{engine="0",model_name="m"} 2.0',
        ]
    )
    monkeypatch.setattr(client.requests, "get", lambda *a, **k: type("R", (), {"text": text})())
    cache = client.Endpoint("http://x", model="m").cache_config()
    assert cache == {"block_size": "128", "enable_prefix_caching": "True"}
    assert cli._describe(cache) == "prefix caching on, block size 128"
    assert cli._describe({}) == "cache configuration not reported"


def measured_target(served_s: float, cached: int, connector: int):
    """A measured target of 100 prompt tokens: cold took 1 s to its first token, the served
    request ``served_s`` with ``cached`` tokens cached, ``connector`` of them claimed by us."""
    from semshare_vllm.bench.client import Completion
    from semshare_vllm.bench.measure import Measured

    return Measured(
        W.BenchRequest("w", "g", "target", "prompt"),
        cold=Completion("a", 1.0, 1.1, 0, 100),
        served=Completion("a", served_s, served_s + 0.1, cached, 100),
        connector_tokens=connector,
    )


def test_a_prompt_served_by_vllms_own_cache_is_neither_hit_nor_miss():
    """With prefix caching on, vLLM serves the next turn of a chat from its own cache: the
    served request's cached tokens come from vLLM, not the connector. Counted as a miss, its
    speed-up read as a negative miss overhead of ours."""
    from semshare_vllm.bench import report

    def target(served_cached: int, connector: int):
        served_s = 0.2 if served_cached else 1.02
        return measured_target(served_s, served_cached, connector)

    by_vllm, hit, miss = target(96, 0), target(99, 99), target(0, 0)
    assert by_vllm.vllm_cached and not by_vllm.hit
    assert hit.hit and not hit.vllm_cached and not miss.vllm_cached
    s = report.summarize([by_vllm, hit, miss])["w"]
    assert s["hits"] == 1 and s["vllm_cache_rate"] == pytest.approx(1 / 3)
    assert s["miss_overhead"] == pytest.approx(0.02)  # the one real miss only
    assert report.request_rows([by_vllm])[0]["vllm_cached"] is True
    line = report.table({512: {"w": s}}).splitlines()[2]
    assert line.startswith("| 512 | w | 3 | 33% | 33% |")


def test_a_declined_load_is_neither_hit_nor_miss_and_its_cost_is_reported():
    """Seen: 2K rag-reorder's two loads were declined (vLLM computed them, 1.26x of cold), yet
    the report said "hit rate 100%", "hits as cold 2 / 2" and a hit-only speed-up of 0.80x.
    A declined load is no hit: it is counted apart, with its TTFT over cold's."""
    from semshare_vllm.bench import report
    from semshare_vllm.bench.measure import _repair_figures

    def target(served_s: float, declined: int):
        m = measured_target(served_s, 99, 99)
        counts = {"recompute_declined": declined, "recompute_escalated_loads": declined}
        _repair_figures(m, {"before": {}, "after": counts})
        return m

    declined, hit = target(1.25, 1), target(0.25, 0)
    assert declined.declined and not declined.hit and not declined.vllm_cached
    assert hit.hit and not hit.declined
    s = report.summarize([declined, hit])["w"]
    assert (s["hits"], s["declined"]) == (1, 1)
    assert s["declined_cost"] == pytest.approx(1.25)
    assert s["hit_only_speedup"] == pytest.approx(4.0) and s["miss_overhead"] is None
    assert s["as_cold_hits"] == 1
    line = report.table({512: {"w": s}}).splitlines()[2]
    assert line.startswith("| 512 | w | 2 | 50% | 0% | 1 (1.25x) |")
    assert report.request_rows([declined])[0]["declined"] is True


def test_what_a_declined_load_cost_is_broken_down():
    """Declines cost 1.18-1.35x of cold at 794c053, and the bench could not say where: a
    declined load's parts come from the connector's ``declined_<part>_ms`` histograms (its
    ``served_`` ones see hits only), into the request's timings and the workload's
    ``breakdown_declined_ms`` (what is left of its TTFT, ``vllm``, is vLLM computing the
    prompt)."""
    from semshare_vllm.bench import report
    from semshare_vllm.bench.measure import _repair_figures

    m = measured_target(1.3, 99, 99)
    after = {"recompute_declined": 1, "recompute_escalated_loads": 1}
    for part, ms in {"search": 20.0, "align": 10.0, "load": 5.0, "recompute": 215.0}.items():
        after[f"declined_{part}_ms_count"], after[f"declined_{part}_ms_sum"] = 1, ms
    _repair_figures(m, {"before": {}, "after": after})
    assert m.declined and m.timings == {"search": 20, "align": 10, "load": 5, "recompute": 215}
    s = report.summarize([m])["w"]
    got = s["breakdown_declined_ms"]
    assert {k: got[k] for k in ("search", "align", "load", "recompute")} == m.timings
    assert got["vllm"] == pytest.approx(1300 - 250)
    assert s["breakdown_hits_ms"]["recompute"] is None
    assert report.request_rows([m])[0]["timings_ms"] == m.timings
    rows = report.breakdown_table({2048: {"w": s}}).splitlines()[2:]
    assert rows == ["| 2,048 | w, declined | 1300 ms | 20 ms | 10 ms | 5 ms | 215 ms | - | "
                    "1050 ms | - | - | - |"]  # fmt: skip


def test_what_a_miss_waited_for_is_broken_down():
    """Edit misses cost +5% to +29% of cold at 794c053 and the bench recorded nothing of why:
    a miss's waits come from the connector's ``missed_<part>_ms`` histograms into its timings
    and the workload's ``breakdown_misses_ms`` (what is left, ``vllm``, is vLLM's prefill)."""
    from semshare_vllm.bench import report
    from semshare_vllm.bench.measure import _repair_figures

    m = measured_target(1.2, 0, 0)
    after = {"missed_search_ms_count": 1, "missed_search_ms_sum": 180.0}
    after |= {"missed_align_ms_count": 1, "missed_align_ms_sum": 0.0}
    _repair_figures(m, {"before": {}, "after": after})
    assert not m.claimed and m.timings == {"search": 180.0, "align": 0.0}
    s = report.summarize([m])["w"]
    assert s["miss_overhead"] == pytest.approx(0.2)
    got = s["breakdown_misses_ms"]
    assert (got["search"], got["align"], got["load"]) == (180.0, 0.0, None)
    assert got["vllm"] == pytest.approx(1200 - 180)
    rows = report.breakdown_table({2048: {"w": s}}).splitlines()[2:]
    assert rows == ["| 2,048 | w, missed | 1200 ms | 180 ms | 0 ms | - | - | - | 1020 ms | - | "
                    "- | - |"]  # fmt: skip
