"""Quality of semantic donor discovery on real text: does it find the donor, and refuse strangers?

No vLLM here: the real embedder, the real VectorIndex and the real SimHash scan
(``semshare_vllm.testbed.discovery_eval``), over the donor/target pairs of
``semshare_vllm.testbed.pairs`` (Wikipedia extracts, the Lee news corpus).
Prints:

(a) Spearman's rho between the embedder's cosine and the Lee corpus' human similarity ratings
    (1,225 document pairs);
(b) per scenario (and edit level), recall@1 at the threshold (all donors in one namespace; a
    hit is the target's own donor ranked first with cosine >= threshold) and the cosine of the
    true pairs, plus what the SimHash near-duplicate scan would match;
(c) the false-donor rate on negatives (top-1 cosine >= threshold) and their top-1 cosines;
(d) recall@1 and false-donor rate at several thresholds, to choose the default.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/discovery_quality.py [--pairs 30]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from semshare_vllm.config import SemShareConfig  # noqa: E402
from semshare_vllm.discovery.embedder import make_embedder  # noqa: E402
from semshare_vllm.discovery.service import NEAR_DUPLICATE_BITS  # noqa: E402
from semshare_vllm.testbed import pairs as P  # noqa: E402
from semshare_vllm.testbed.discovery_eval import (  # noqa: E402
    evaluate,
    false_donor_rate,
    lee_spearman,
    recall_at_1,
)
from semshare_vllm.testbed.models import smollm2_tokenizer  # noqa: E402

TABLE_THRESHOLDS = (0.5, 0.6, 0.7, 0.8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--pairs",
        type=int,
        default=30,
        help="pairs per scenario (for 'edited': donors, each at every level)",
    )
    parser.add_argument(
        "--negatives", type=int, default=None, help="negative targets (default: 3 x --pairs)"
    )
    parser.add_argument("--embedder", choices=("onnx", "sentence-transformers"), default="onnx")
    parser.add_argument(
        "--threshold",
        type=float,
        default=SemShareConfig().similarity_threshold,
        help="cosine a donor needs (default: the config's similarity_threshold)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="embedder CPU threads")
    args = parser.parse_args()

    t_start = time.perf_counter()
    embedder = make_embedder(args.embedder, device="cpu", threads=args.threads)
    tokenizer = smollm2_tokenizer()
    pairs, negatives = P.build(args.pairs, negatives=args.negatives, seed=args.seed)
    t_ready = time.perf_counter()

    t0 = time.perf_counter()
    rho = lee_spearman(embedder)
    lee_s = time.perf_counter() - t0
    result = evaluate(embedder, pairs, negatives, args.threshold, tokenizer)

    print(
        f"embedder {embedder.name}, threshold {args.threshold:g}, seed {args.seed}; "
        f"{result['donors']} donors in one namespace, {len(pairs)} targets, "
        f"{len(negatives)} negatives"
    )
    print(f"\n(a) Lee corpus: Spearman rho(cosine, human rating) over 1225 pairs = {rho:.3f}")

    print(
        f"\n(b) recall@1 at threshold {args.threshold:g}, cosine of the true pairs, and the "
        f"SimHash scan (<= {NEAR_DUPLICATE_BITS} bits)"
    )
    print(
        f"  {'scenario':<20}{'n':>4}{'recall@1':>10}{'mean':>8}{'median':>8}{'min':>8}"
        f"{'simhash matched':>17}{'correct':>9}"
    )
    for name, g in result["groups"].items():
        print(
            f"  {name:<20}{g['n']:>4}{g['recall']:>10.2f}{g['mean_cos']:>8.3f}"
            f"{g['median_cos']:>8.3f}{g['min_cos']:>8.3f}{g['simhash_matches']:>17}"
            f"{g['simhash_correct']:>9}"
        )
    misses = [o for o in result["outcomes"] if o.true_key is not None and o.top_key != o.true_key]
    print(
        f"  targets whose top-1 is another donor (at any score): {len(misses)}"
        + (
            f", top-1 cosines {', '.join(f'{o.group}:{o.top_score:.2f}' for o in misses[:8])}"
            if misses
            else ""
        )
    )

    neg = result["negatives"]
    print(
        f"\n(c) negatives (n={neg['n']}): false-donor rate at {args.threshold:g} = "
        f"{neg['false_donor_rate']:.3f}; top-1 cosine median {neg['median_top']:.3f}, "
        f"p95 {neg['p95_top']:.3f}, max {neg['max_top']:.3f}; SimHash matches "
        f"{neg['simhash_matches']}"
    )

    print("\n(d) recall@1 per scenario and false-donor rate by threshold")
    names = list(result["groups"])
    short = [
        n.replace("cross-instruction", "x-instr")
        .replace("reordered", "reorder")
        .replace("edited@", "ed")
        for n in names
    ]
    print("  " + f"{'thr':>5}" + "".join(f"{s:>9}" for s in short) + f"{'false':>8}")
    outcomes = result["outcomes"]
    thresholds = sorted(set(TABLE_THRESHOLDS) | {args.threshold})
    for t in thresholds:
        row = [recall_at_1([o for o in outcomes if o.group == n], t) for n in names]
        fdr = false_donor_rate([o for o in outcomes if o.group == "negative"], t)
        print("  " + f"{t:>5.2f}" + "".join(f"{r:>9.2f}" for r in row) + f"{fdr:>8.3f}")

    total = time.perf_counter() - t_start
    print(
        f"\nwall time {total:.1f} s (load {t_ready - t_start:.1f} s, Lee {lee_s:.1f} s, "
        f"embedding {result['texts']} texts {result['embed_s']:.1f} s)"
    )


if __name__ == "__main__":
    main()
