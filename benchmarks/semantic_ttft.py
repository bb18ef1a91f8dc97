"""Semantic hits through `vllm serve`: client-side streaming TTFT, cold vs hit, and ROUGE-L of the
hit's greedy output against the cold output of the same prompt; miss overhead on negatives.

Cross-instruction pairs of real Wikipedia text at ``--sizes`` document tokens: the donor is the
document under instruction A, the measured target the same document under a longer instruction B
(no common prefix). Two servers run one after the other in this invocation, on the same prompts:
no connector (cold), and SemShare (defaults: CacheBlend, r = 15%). On the SemShare server each
donor is sent and embedded first. Miss overhead: per case two unrelated documents of the same
size, one searched by the connector and one opted out (``kv_transfer_params``), in alternating
order on the SemShare server (same server, same time), and both against the cold server.

    .venv/bin/python benchmarks/semantic_ttft.py [--docs 3] [--sizes 512 1024 2048]
        [--extra-config '{"recompute_min_tokens": 160}']
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from semshare_vllm.testbed import models
from semshare_vllm.testbed.scoring import rouge_l
from semshare_vllm.testbed.server import SEMSHARE, VllmServer, stop_servers_on_terminate
from semshare_vllm.testbed.text import wiki_document

HEAD_A = "Read the article below and answer the question after it.\n\n"
HEAD_B = (
    "You are a careful assistant. The following text comes from an encyclopedia; read "
    "all of it before you answer, and answer in one short sentence.\n\n"
)
QUESTION = "\n\nQuestion: What is the article about? Answer:"
LAYERS = 30


def prompts(tok, sizes, docs):
    out = {}
    for size in sizes:
        for i in range(docs):
            doc = tok.decode(
                tok(wiki_document(4000 + 97 * i + size, 8 * size), add_special_tokens=False)[
                    "input_ids"
                ][:size]
            )
            neg, neg_off = (
                tok.decode(
                    tok(wiki_document(start + 97 * i + size, 8 * size), add_special_tokens=False)[
                        "input_ids"
                    ][:size]
                )
                for start in (7000, 8500)
            )
            out[(size, i)] = {
                "donor": HEAD_A + doc + QUESTION,
                "target": HEAD_B + doc + QUESTION,
                "negative": neg + QUESTION,
                "negative_off": neg_off + QUESTION,
            }
    return out


def wait_embedded(srv, n, timeout_s=300):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if srv.connector_stats().get("donors_embedded", 0) >= n:
            return
        srv.complete("ping " * 3, max_tokens=1, kv_transfer_params={"semshare": "off"})
        time.sleep(0.5)
    raise TimeoutError("donors were not embedded")


def run(name, model, kv, cases, max_tokens, workdir):
    import os

    os.environ["VLLM_LOG_STATS_INTERVAL"] = "1"
    out = {}
    with VllmServer(
        model,
        kv,
        ["--block-size", "32", "--enable-prompt-tokens-details"],
        workdir / f"{name}.log",
        max_model_len=4096,
    ) as srv:
        srv.complete("Hello, world. " * 20, max_tokens=2)  # warm-up
        if kv is not None:
            for case in cases.values():
                srv.complete(case["donor"], max_tokens=2)
            wait_embedded(srv, len(cases))
        for i, (key, case) in enumerate(cases.items()):
            t = srv.complete(case["target"], max_tokens=max_tokens)
            # two unrelated prompts, one with the connector searching and one opted out, in
            # alternating order: the miss overhead measured on one server at one time
            negatives = [
                ("neg_ttft", case["negative"], None),
                ("neg_off_ttft", case["negative_off"], {"semshare": "off"}),
            ]
            out[key] = {
                "ttft": t.ttft_s,
                "text": t.text,
                "cached": t.cached_tokens or 0,
                "prompt": t.prompt_tokens or 0,
            }
            for name, prompt, params in negatives[:: 1 if i % 2 else -1]:
                out[key][name] = srv.complete(
                    prompt, max_tokens=2, kv_transfer_params=(params if kv is not None else None)
                ).ttft_s
        stats = srv.connector_stats()
    return out, stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--docs", type=int, default=3)
    parser.add_argument("--sizes", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument(
        "--extra-config",
        type=json.loads,
        default={},
        help='connector keys to set, as JSON (e.g. {"recompute_ratio": 0.3})',
    )
    args = parser.parse_args()
    model = str(models.smollm2())
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    cases = prompts(tok, args.sizes, args.docs)
    workdir = Path(tempfile.mkdtemp(prefix="semshare-semantic-"))
    print(f"server logs: {workdir}", file=sys.stderr)
    cold, _ = run("cold", model, None, cases, args.max_tokens, workdir)
    kv = dict(SEMSHARE)
    if args.extra_config:
        kv["kv_connector_extra_config"] = args.extra_config
    hit, stats = run("semshare", model, kv, cases, args.max_tokens, workdir)

    from semshare_vllm.config import SemShareConfig

    config = SemShareConfig.from_extra_config(args.extra_config)
    print(
        f"\n## Semantic hits through vllm serve (SmolLM2-135M, CPU; cross-instruction pairs, "
        f"{args.docs} documents per size; medians; CacheBlend r = "
        f"{config.recompute_ratio:.0%}, at least {config.recompute_min_tokens} tokens)"
    )
    print(
        "| doc tokens | prompt tokens | cold TTFT | hit TTFT | speed-up | r | ceiling | "
        "of ceiling | reused | ROUGE-L(hit, cold) | miss overhead (vs opted out, same "
        "server) | miss overhead (vs cold server) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for size in args.sizes:
        keys = [k for k in cases if k[0] == size]
        c = statistics.median(cold[k]["ttft"] for k in keys)
        h = statistics.median(hit[k]["ttft"] for k in keys)
        prompt = statistics.median(hit[k]["prompt"] for k in keys)
        r = min(1.0, max(config.recompute_ratio, config.recompute_min_tokens / prompt))
        ceiling = LAYERS / (1.25 + 0.75 * r + r * (LAYERS - 2))
        reused = statistics.median(hit[k]["cached"] / hit[k]["prompt"] for k in keys)
        rouge = statistics.median(rouge_l(hit[k]["text"], cold[k]["text"]) for k in keys)
        same = statistics.median(hit[k]["neg_ttft"] for k in keys) / statistics.median(
            hit[k]["neg_off_ttft"] for k in keys
        )
        miss = statistics.median(hit[k]["neg_ttft"] / cold[k]["neg_ttft"] for k in keys)
        print(
            f"| {size:,} | {prompt:.0f} | {c * 1e3:.0f} ms | {h * 1e3:.0f} ms | {c / h:.2f}x | "
            f"{r:.0%} | {ceiling:.2f}x | {c / h / ceiling:.2f} | {reused:.2f} | {rouge:.2f} | "
            f"{same - 1:+.1%} | {miss - 1:+.1%} |"
        )
    keys = (
        "semantic_hits",
        "hit_tokens",
        "exact_reused_tokens",
        "fuzzy_reused_tokens",
        "recomputed_tokens",
        "recomputed_token_layers",
        "align_ms",
        "load_ms",
        "recompute_ms",
        "deviation_sum",
        "deviation_count",
        "semantic_misses",
        "lookups_without_shared_grams",
        "lookup_timeouts",
        "align_timeouts",
        "lookup_wait_ms",
    )
    print("\nconnector totals: " + ", ".join(f"{k}={stats.get(k, 0):.3g}" for k in keys))


if __name__ == "__main__":
    with stop_servers_on_terminate():  # a killed run stops its servers too
        main()
