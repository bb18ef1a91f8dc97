"""How close is the KV an alignment hands each target token to the KV the model computes for it?

For real donor/target pairs, SmolLM2-135M (Hugging Face, fp32, CPU) computes both prompts' KV.
Every aligned target token takes its donor token's K (RoPE-corrected from the donor position to
the target position with ``kernels.correct_rope``, angles from vLLM's own rotary module) and V;
the relative L2 error ``|kv_donor - kv_target| / |kv_target|`` (per token, over heads) is
reported by what aligned the token, at a few layers (medians). Two references: the same
alignment without RoPE correction (K only), and a random donor token (corrected).

This is what the recompute stage starts from: a low error means little to repair.

    .venv/bin/python benchmarks/alignment_kv_deviation.py [--pairs 2]
"""

from __future__ import annotations

import argparse
import random
import statistics
from dataclasses import replace

import numpy as np
import torch

from semshare_vllm.alignment import AlignParams, EmbeddingTable, SentenceSplitter, align
from semshare_vllm.alignment.result import Alignment, MatchKind
from semshare_vllm.kernels import RopeTable, correct_rope
from semshare_vllm.testbed import pairs as P
from semshare_vllm.testbed.models import smollm2, smollm2_tokenizer

LAYERS = (0, 1, 8, 15, 29)


def model_kv(model, ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, post-RoPE K and V as ``[T, kv_heads, head_dim]``."""
    with torch.no_grad():
        cache = model(torch.tensor([ids]), use_cache=True).past_key_values
    out = []
    for layer in cache.layers:
        out.append(
            (
                layer.keys[0].transpose(0, 1).contiguous(),
                layer.values[0].transpose(0, 1).contiguous(),
            )
        )
    return out


def rope_table(model) -> RopeTable:
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    cfg = model.config
    head = cfg.hidden_size // cfg.num_attention_heads
    theta = getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]
    with set_current_vllm_config(VllmConfig()):  # vLLM's custom ops need a config to exist
        rope = get_rope(
            head,
            8192,
            is_neox_style=True,
            rope_parameters={"rope_type": "default", "rope_theta": theta},
        )
    return RopeTable.from_vllm(rope)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> np.ndarray:
    return ((a - b).flatten(1).norm(dim=1) / b.flatten(1).norm(dim=1).clamp_min(1e-6)).numpy()


def categories(al: Alignment, stages_to: dict[str, Alignment]) -> dict[str, np.ndarray]:
    """Target positions by what aligned them. ``stages_to``: per stage, the alignment of the same
    pair by the stages up to it (each stage only fills what the earlier ones left, so a position
    belongs to the first stage whose alignment covers it)."""
    n = len(al.donor_pos)
    head = np.zeros(n, dtype=bool)
    in_run = np.zeros(n, dtype=bool)
    for run in stages_to["exact"].runs:  # runs of the exact stage
        in_run[run.target_start : run.target_start + run.length] = True
        head[run.target_start : run.target_start + min(4, run.length)] = True
    by_edit = (stages_to["sentence"].donor_pos >= 0) & ~in_run  # edit or sentence stage
    lsh = (al.donor_pos >= 0) & ~in_run & ~by_edit
    kind = al.kind
    return {
        "run, first 4 tokens": np.flatnonzero(head),
        "run, rest": np.flatnonzero(in_run & ~head),
        "edit/sentence: equal token": np.flatnonzero(by_edit & (kind == MatchKind.EXACT)),
        "edit/sentence: replaced word": np.flatnonzero(by_edit & (kind == MatchKind.FUZZY)),
        "lsh: same token": np.flatnonzero(lsh & (kind == MatchKind.EXACT)),
        "lsh: other token": np.flatnonzero(lsh & (kind == MatchKind.FUZZY)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=2)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(smollm2()), dtype=torch.float32)
    model.eval()
    tok = smollm2_tokenizer()
    table, splitter = EmbeddingTable.load(smollm2()), SentenceSplitter.from_tokenizer(tok)
    rope = rope_table(model)

    pairs, _ = P.build(args.pairs, seed=3)
    chosen = [
        p
        for p in pairs
        if p.kind in ("cross-instruction", "reordered") or (p.kind == "edited" and p.level == 0.5)
    ]
    cases = [(P.group_of(p), p.target, p.donor) for p in chosen]
    rng = random.Random(0)
    words = " ".join(p.donor for p in pairs[:2]).split()
    for p in [p for p in pairs if p.kind == "cross-instruction"]:
        cases.append(("reworded@0.2", P.reword_document(p.donor, 0.2, rng, words), p.donor))

    rows: dict[tuple[str, int], list[np.ndarray]] = {}
    for _, target, donor in cases:
        t, d = tok(target)["input_ids"], tok(donor)["input_ids"]
        params = AlignParams()
        al = align(t, d, params, table, splitter)
        stages_to = {
            stage: align(t, d, replace(params, stages=params.stages[: i + 1]), table, splitter)
            for i, stage in enumerate(params.stages)
        }
        kv_t, kv_d = model_kv(model, t), model_kv(model, d)
        src_all = torch.as_tensor(al.donor_pos)
        randpos = torch.as_tensor(np.random.default_rng(0).integers(0, len(d), len(t)))
        for name, idx in categories(al, stages_to).items():
            if not len(idx):
                continue
            tgt = torch.as_tensor(idx)
            src = src_all[tgt]
            for layer in LAYERS:
                (kt, vt), (kd, vd) = kv_t[layer], kv_d[layer]
                k_fixed = correct_rope(kd[src], src, tgt, rope)
                rows.setdefault((name, layer), []).append(
                    np.stack(
                        [
                            rel_err(k_fixed, kt[tgt]),
                            rel_err(vd[src], vt[tgt]),
                            rel_err(kd[src], kt[tgt]),
                        ]
                    )
                )
        tgt = torch.arange(len(t))
        for layer in LAYERS:
            (kt, vt), (kd, vd) = kv_t[layer], kv_d[layer]
            rows.setdefault(("random donor token", layer), []).append(
                np.stack(
                    [
                        rel_err(correct_rope(kd[randpos], randpos, tgt, rope), kt),
                        rel_err(vd[randpos], vt),
                        rel_err(kd[randpos], kt),
                    ]
                )
            )

    names = list(dict.fromkeys(name for name, _ in rows))
    print(
        f"## Donor KV vs the target's own KV (SmolLM2-135M fp32, {len(cases)} real pairs; "
        "median relative L2 error per token)"
    )
    print(
        "| aligned by | tokens | "
        + " | ".join(f"K / V, layer {layer}" for layer in LAYERS)
        + " | K without RoPE correction, layer 15 |"
    )
    print("|---|---|" + "---|" * (len(LAYERS) + 1))
    for name in names:
        cells = []
        count = 0
        for layer in LAYERS:
            errs = np.concatenate(rows[(name, layer)], axis=1)
            count = errs.shape[1]
            cells.append(f"{np.median(errs[0]):.3f} / {np.median(errs[1]):.3f}")
        raw = np.concatenate(rows[(name, 15)], axis=1)[2]
        print(f"| {name} | {count} | " + " | ".join(cells) + f" | {statistics.median(raw):.3f} |")


if __name__ == "__main__":
    main()
