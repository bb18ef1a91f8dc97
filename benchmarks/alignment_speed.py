"""Exact-run alignment: speed at 2K / 8K tokens, and coverage on real donor/target pairs.

1. Speed: a real document (Wikipedia extracts) of N SmolLM2 tokens as the donor; the target is
   the same text with its passages reordered behind another header (the RAG case, several
   runs). Median of repeated ``align_exact`` calls (the issue's target: <= 5 ms at 8K).
2. Coverage: ``testbed.pairs`` (cross-instruction, reordered, edited at 10-90 %), tokenised with
   SmolLM2's tokenizer: exact coverage of the target and number of runs, per scenario (medians).

    .venv/bin/python benchmarks/alignment_speed.py [--repeats 20] [--pairs 10]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from semshare_vllm.alignment.exact_runs import align_exact
from semshare_vllm.testbed import pairs as P
from semshare_vllm.testbed.text import wiki_extracts


def reordered_prompt_pair(tok, n_tokens: int, seed: int = 0) -> tuple[list[int], list[int]]:
    """Donor: consecutive extracts up to ``n_tokens``; target: the same extracts shuffled,
    behind another header, cut to the same length."""
    extracts = wiki_extracts()
    rng = np.random.default_rng(seed)
    chosen, size, i = [], 0, int(rng.integers(0, 5000))
    while size < n_tokens:
        title, body = extracts[i]
        chosen.append(f"{title}\n{body}\n\n")
        size += len(tok(chosen[-1])["input_ids"])
        i += 1
    donor = tok("Use these passages.\n\n" + "".join(chosen))["input_ids"][:n_tokens]
    shuffled = [chosen[j] for j in rng.permutation(len(chosen))]
    target = tok("Sources, in another order:\n\n" + "".join(shuffled))["input_ids"][:n_tokens]
    return target, donor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--pairs", type=int, default=10)
    args = parser.parse_args()
    tok = P.smollm2_tokenizer()

    print("## Exact-run alignment speed (reordered passages, median of "
          f"{args.repeats})")
    print("| tokens | median | runs | exact coverage |")
    print("|---|---|---|---|")
    for n in (2048, 8192):
        target, donor = reordered_prompt_pair(tok, n)
        al = align_exact(target, donor)
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            align_exact(target, donor)
            times.append((time.perf_counter() - t0) * 1e3)
        print(f"| {n:,} | {statistics.median(times):.2f} ms | {al.num_runs} | "
              f"{al.exact_coverage:.3f} |")

    pairs, _ = P.build(args.pairs, seed=0)
    groups: dict[str, list] = {}
    for pair in pairs:
        t = tok(pair.target)["input_ids"]
        d = tok(pair.donor)["input_ids"]
        al = align_exact(t, d)
        groups.setdefault(P.group_of(pair), []).append((al.exact_coverage, al.num_runs, len(t)))
    print(f"\n## Exact coverage on real pairs ({args.pairs} per scenario, medians)")
    print("| scenario | target tokens | exact coverage | runs |")
    print("|---|---|---|---|")
    for name, rows in groups.items():
        cov, runs, lens = zip(*rows)
        print(f"| {name} | {statistics.median(lens):.0f} | {statistics.median(cov):.3f} | "
              f"{statistics.median(runs):.0f} |")


if __name__ == "__main__":
    main()
