"""The recompute section: which loaded tokens are recomputed after an approximate load."""

from __future__ import annotations

from dataclasses import dataclass

from semshare_vllm.config.knobs import Section, knob


@dataclass(frozen=True)
class RecomputeConfig(Section):
    """Which loaded tokens are recomputed through the model after an approximate (semantic)
    load: the policy and its budgets."""

    TITLE = "Selective recompute"

    recompute_policy: str = knob(
        "adaptive",
        "Which loaded tokens are recomputed through the model after their donor KV "
        'is written, for approximate (semantic) loads: "adaptive" (every loaded token up to '
        "recompute_check_layer, then as many as bring the measured error under "
        "recompute_error_bound, checked again at recompute_gate_layer and escalated there, up "
        'to every token, where it is not), "cacheblend" (every loaded token up '
        "to recompute_check_layer, then the recompute_ratio with the highest K/V deviation), "
        '"semsharekv" (layer 0 in full, then hot / cold tokens by attention recovery, a '
        'budget decaying with depth), "all" (every loaded token, exact loads included: the '
        "output equals a cold run and nothing is saved; checks the hook and runner in a "
        'deployment), "none". Exact-prefix loads are never repaired except under "all". '
        'With "none" there are no semantic hits (approximate KV is never used unrepaired).',
        choices=("none", "all", "adaptive", "cacheblend", "semsharekv"),
    )
    recompute_error_bound: float = knob(
        0.02,
        "Adaptive: the error a repaired load may keep, as the gate layer measures it: the K/V "
        "deviation (relative L2) of the tokens not recomputed, weighted half by the attention "
        "the prompt's last tokens pay them and half uniformly (a weighted mean over the loaded "
        "tokens: 0 = exact). The check layer aims at an eighth of it (the error left grew "
        "4-10x between layers 1 and 8 on real pairs); the gate corrects. At 0.02, on 7 real "
        "pairs (SmolLM2-135M), the last token's final hidden state stayed within 4% of cold's "
        "(docs/benchmarks.md, fidelity).",
        minimum=0.0,
    )
    recompute_min_share: float = knob(
        0.0,
        "Adaptive: recompute at least this share of the loaded tokens after the check layer.",
        minimum=0.0,
        maximum=1.0,
    )
    recompute_max_share: float = knob(
        1.0,
        "Adaptive: recompute at most this share of the loaded tokens after the check layer "
        "(the gate may still escalate past it: a load is never served above the bound it "
        "measured).",
        minimum=0.0,
        maximum=1.0,
    )
    recompute_decline_share: float = knob(
        0.5,
        "Adaptive: where the check layer's choice, or the gate's escalation, would recompute "
        "more than this share of the loaded tokens, the load is declined instead and vLLM "
        "computes the prompt (counted as recompute_declined; the request is served as cold). "
        "Like an escalation, a decline withholds that donor from that prompt from then on, and "
        "a donor two prompts needed more from is demoted. Past about half the tokens, the "
        "recompute costs more than vLLM's own prefill. 1.0: escalate up to every token in the "
        "recompute.",
        minimum=0.0,
        maximum=1.0,
    )
    recompute_gate_layer: int = knob(
        8,
        "Adaptive: the layer (0-based) where the error left is measured again, on sentinel "
        "tokens carried there; above recompute_error_bound, the same recompute escalates "
        "(more tokens, then every one). At or below recompute_check_layer: no gate.",
        minimum=0,
    )
    recompute_sentinels: float = knob(
        0.03,
        "Adaptive: share of the loaded tokens (at least 8, at most recompute_max_sentinels) "
        "carried past the check layer to the "
        "gate layer to measure what the tokens not recomputed would deviate there.",
        minimum=0.0,
        maximum=1.0,
    )
    recompute_max_sentinels: int = knob(
        64,
        "Adaptive: the most sentinel tokens carried to the gate layer, whatever "
        "recompute_sentinels gives (long prompts). The gate's estimate is as precise as its "
        "sample is large, not as its share of the prompt: resampled on 9 real targets of 4K "
        "tokens, its decision went the other way from the true error's in 1.2% of draws of 32 "
        "sentinels, 0.7% of 64, none of 128 (benchmarks/gate_sentinels.py). Each sentinel costs "
        "a token's work in every layer up to the gate (docs/benchmarks.md, sentinels).",
        minimum=8,
    )
    recompute_attention_window: int = knob(
        32,
        "Adaptive: how many of the prompt's last tokens' attention weighs each token's "
        "deviation (the tokens the answer is read from).",
        minimum=1,
    )
    recompute_ratio: float = knob(
        0.15,
        "CacheBlend: share of the loaded tokens recomputed after the check layer "
        "(CacheBlend's own default).",
        minimum=0.0,
        maximum=1.0,
    )
    recompute_min_tokens: int = knob(
        0,
        "CacheBlend and adaptive: recompute at least this many loaded tokens after the check "
        "layer, "
        "whatever recompute_ratio gives (short prompts: 15% of a few hundred tokens can leave a "
        "near-tie answer to the donor's context). On 512-token cross-instruction pairs "
        "(SmolLM2-135M, CPU, 6 pairs) a floor of 160 (29%) raised the median ROUGE-L of the "
        "hit's 32 greedy tokens against cold's from 0.56 to 0.71. 0: the ratio alone.",
        minimum=0,
    )
    recompute_check_layer: int = knob(
        1,
        "CacheBlend and adaptive: the layer (0-based) up to which every loaded token is "
        "recomputed and where deviations are measured.",
        minimum=0,
    )
    recompute_run_head: int = knob(
        4,
        "Always recomputed: this many first tokens of every stretch aligned to consecutive "
        "donor positions, a lone aligned token included (they attended to other tokens in "
        "the donor; measured: 3x the K/V error of the rest of a run).",
        minimum=0,
    )
    recompute_tail: int = knob(8, "Always recomputed: this many last loaded tokens.", minimum=0)
    recompute_echo_span: int = knob(
        24,
        "Always recomputed, on semantic loads, where > 0: each aligned pair of tokens that "
        "came earlier in the text the two prompts do not share (a question naming a title "
        "that a passage names too; a pair seen more than 3 times in the shared text is not "
        "one), with this many tokens after it, within recompute_echo_max_share of the load. "
        "The deeper layers read such a passage in the other prompt's context, which the check "
        "layer's deviation does not show. End to end (semshare-bench, six workloads, "
        "SmolLM2-135M), 24 against 0: at 1K and 2K tokens (48 targets, before the cap) the "
        "pooled perplexity ratio of doc-qa hits went from 1.026 / 1.027 to 1.010 / 1.008, of "
        "rag-qa from 1.055 / 1.003 to 1.026 / 0.980, 4 loads were declined instead of 7, the "
        "share of doc-qa hits rose from 0.08-0.09 to 0.12-0.15 (their 2K speed-up 11.7x to "
        "8.0x); at 512 (22 targets, capped) doc-qa's ratio went from 1.027 to 1.011 "
        "(docs/benchmarks.md, echoes). 0: off.",
        minimum=0,
        maximum=4096,
    )
    recompute_echo_max_share: float = knob(
        0.1,
        "The echoes' spans (recompute_echo_span) hold at most this share of a load: past it "
        "every echo's span is shortened alike (down to the pairs alone, then the first pairs). "
        "Aligned offline, the six bench workloads' spans held 0-12% of a load at 1K and 2K "
        "tokens, up to 21% at 512; uncapped, a 512-token cross-instruction hit escalated past "
        "recompute_decline_share and was declined, capped at 0.1 it was a hit, 1.6x faster "
        "than cold (docs/benchmarks.md, echoes).",
        minimum=0.0,
        maximum=1.0,
    )
    semsharekv_hot_threshold: float = knob(
        0.55,
        "SemShareKV: share of the last tokens' attention that the hot tokens hold "
        "(attention recovery).",
        minimum=0.0,
        maximum=1.0,
    )
    semsharekv_hot_ratio: float = knob(
        0.5,
        "SemShareKV: share of the hot tokens recomputed (highest deviation first).",
        minimum=0.0,
        maximum=1.0,
    )
    semsharekv_cold_ratio: float = knob(
        0.1, "SemShareKV: share of the cold tokens recomputed.", minimum=0.0, maximum=1.0
    )
    semsharekv_layer_decay: float = knob(
        0.9,
        "SemShareKV: the recompute budget is multiplied by this per layer after layer 0 "
        "(the paper's constant is unpublished).",
        minimum=0.0,
        maximum=1.0,
    )
    semsharekv_window: int = knob(
        32,
        "SemShareKV: how many last tokens' attention defines hot tokens (unpublished in "
        "the paper; an independent reimplementation uses 32).",
        minimum=1,
    )
    tp_semantic_reuse: bool = knob(
        False,
        "Serve semantic hits when tensor_parallel_size > 1. Every rank then recomputes the same "
        "positions (the policy's scores are summed over the ranks before it chooses) and a load "
        "or repair that fails on one rank fails on all. Tested end to end on vLLM's CPU build "
        "at TP=2 only, not yet with CUDA on several GPUs. Off: under tensor parallelism, "
        "exact-prefix reuse only (one warning at start-up). No effect at TP=1.",
    )
