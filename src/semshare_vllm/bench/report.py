"""From measured requests to figures: per workload and context length, the TTFT statistics under
``vllm bench serve``'s names (``median_ttft_ms``, ``p99_ttft_ms``, ...) for cold and served
requests, and ours: hit rate, hit-only speed-up, blended speed-up, miss overhead, ROUGE-L of the
served output against cold's, the perplexity ratio (hit over cold) of held-out reference text,
accuracy where answers are checkable, and where a target's text changed a value its donor's
stated (entity-swap), how many served answers gave the donor's value."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import numpy as np

from semshare_vllm.bench.measure import TIMINGS, Measured
from semshare_vllm.testbed.scoring import rouge_l


def _ttft(completions) -> dict[str, float]:
    ms = np.array([c.ttft_s * 1e3 for c in completions], dtype=np.float64)
    if not len(ms):
        return {}
    return {
        "mean_ttft_ms": float(ms.mean()),
        "median_ttft_ms": float(np.median(ms)),
        "std_ttft_ms": float(ms.std()),
        "p99_ttft_ms": float(np.percentile(ms, 99)),
        "mean_e2el_ms": float(np.mean([c.total_s * 1e3 for c in completions])),
        "median_tpot_ms": _median_tpot_ms(completions),
    }


def _median_tpot_ms(completions) -> float | None:
    return _median(None if c.tpot_s is None else c.tpot_s * 1e3 for c in completions)


def _ratio(a: list[float], b: list[float]) -> float | None:
    return statistics.median(a) / statistics.median(b) if a and b else None


def summarize(results: list[Measured]) -> dict:
    """One summary per (workload, context length in the request's group name's run)."""
    out: dict[str, dict] = {}
    for name in dict.fromkeys(m.request.workload for m in results):
        rows = [m for m in results if m.request.workload == name]
        hits = [m for m in rows if m.hit]
        declined = [m for m in rows if m.declined]
        misses = [m for m in rows if not m.claimed and not m.vllm_cached]
        checked = [m for m in rows if m.request.answer]
        summary = {
            "targets": len(rows),
            "hits": len(hits),
            "hit_rate": len(hits) / len(rows),
            # served by vLLM's own prefix cache instead (neither hits nor misses)
            "vllm_cache_rate": _mean([m.vllm_cached for m in rows]),
            # claimed, then declined (vLLM computed them): how many, and their TTFT over cold's
            "declined": len(declined),
            "declined_cost": _ratio(
                [m.served.ttft_s for m in declined], [m.cold.ttft_s for m in declined]
            ),
            "median_prompt_tokens": statistics.median(m.prompt_tokens for m in rows),
            "reused_share_of_hits": statistics.median(
                m.connector_tokens / m.prompt_tokens for m in hits
            )
            if hits
            else None,
            "cold": _ttft([m.cold for m in rows]),
            "semshare": _ttft([m.served for m in rows]),
            "semshare_hits": _ttft([m.served for m in hits]),
            "hit_only_speedup": _ratio(
                [m.cold.ttft_s for m in hits], [m.served.ttft_s for m in hits]
            ),
            "blended_speedup": _ratio(
                [m.cold.ttft_s for m in rows], [m.served.ttft_s for m in rows]
            ),
            "miss_overhead": (
                _ratio([m.served.ttft_s for m in misses], [m.cold.ttft_s for m in misses]) or 1.0
            )
            - 1.0
            if misses
            else None,
            "rouge_l_hits": statistics.median(rouge_l(m.served.text, m.cold.text) for m in hits)
            if hits
            else None,
            # per hit, not a median: how many gave cold's very text, and the lowest ROUGE-L (a
            # median of 1.00 hid 6 of 36 hits that parted from cold at near-ties)
            "as_cold_hits": sum(m.served.text == m.cold.text for m in hits) if hits else None,
            "rouge_l_hits_min": min(rouge_l(m.served.text, m.cold.text) for m in hits)
            if hits
            else None,
            # cold against cold (beside another request): the floor ROUGE-L (hits) is read against
            "rouge_l_noise_floor": _median(
                rouge_l(m.noise.text, m.cold.text) for m in rows if m.noise is not None
            ),
            "perplexity_ratio_hits": _median(m.perplexity_ratio for m in hits),
            # the same over the hits' references taken as one text (every token weighs alike):
            # references of a few tokens (doc-qa's answers) scatter either way one by one
            "perplexity_ratio_pooled_hits": _pooled_perplexity_ratio(hits),
            # the repair the hits got (recompute_policy adaptive: the share the gate let stand)
            "recompute_share_hits": _median(m.recompute_share for m in hits),
            "escalation_rate_hits": _mean([m.escalated for m in hits if m.escalated is not None])
            if any(m.escalated is not None for m in hits)
            else None,
            "breakdown_hits_ms": _breakdown(hits),
            # what the declined loads spent before vLLM computed their prompts ("vllm": that)
            "breakdown_declined_ms": _breakdown(declined) if declined else None,
            "semshare_declined": _ttft([m.served for m in declined]),
            # what the misses waited for before vLLM computed them ("vllm": that)
            "breakdown_misses_ms": _breakdown(misses, ("search", "align")) if misses else None,
            "semshare_misses": _ttft([m.served for m in misses]),
            "recompute_layers_hits_ms": _per_layer(hits),
            "reference_perplexity_cold": _median(
                math.exp(m.cold_nll) for m in rows if m.cold_nll is not None
            ),
            "accuracy_semshare": sum(_correct(m.served.text, m.request.answer) for m in checked)
            / len(checked)
            if checked
            else None,
            "accuracy_cold": sum(_correct(m.cold.text, m.request.answer) for m in checked)
            / len(checked)
            if checked
            else None,
            **_donor_values(rows),
        }
        levels = sorted({m.request.level for m in rows if m.request.level is not None})
        if levels:
            summary["by_edit_level"] = {
                f"{lvl:.1f}": {
                    "hit_rate": _mean([m.hit for m in rows if m.request.level == lvl]),
                    "rouge_l": statistics.median(
                        rouge_l(m.served.text, m.cold.text) for m in rows if m.request.level == lvl
                    ),
                    "perplexity_ratio": _median(
                        m.perplexity_ratio for m in rows if m.request.level == lvl
                    ),
                }
                for lvl in levels
            }
        layers = summary["recompute_layers_hits_ms"]
        summary["ceiling_hits"] = ceiling(
            summary["recompute_share_hits"], len(layers) if layers else None
        )
        summary["of_ceiling_hits"] = (
            summary["hit_only_speedup"] / summary["ceiling_hits"]
            if summary["ceiling_hits"] and summary["hit_only_speedup"]
            else None
        )
        out[name] = summary
    return out


def ceiling(share: float | None, layers: int | None) -> float | None:
    """Issue 21's ceiling on a hit's speed-up for its recompute share (recomputed token-layers
    over served ones, layers 0 and 1 counted whole): layer 0 in full, a quarter of layer 1 (the
    probe's K/V of every position), the rest of layer 1 and every layer after it for the share
    r of the tokens: L / (1.25 + 0.75r + r(L - 2)). None: share or layer count unknown."""
    if share is None or not layers or layers < 3:
        return None
    r = max(0.0, (share * layers - 2) / (layers - 2))
    return layers / (1.25 + 0.75 * r + r * (layers - 2))


def _breakdown(hits: list[Measured], parts=TIMINGS) -> dict[str, float | None]:
    """Medians over the hits (or the declined loads, or the misses) of each part of their time
    the connector reports, and of what is left of the hit's TTFT besides (``vllm``: vLLM's own
    scheduling and forward, the first sample, the HTTP round trip), over the hits that reported
    every part it subtracts (``parts``: a miss has no load or recompute); and of their time per
    output token (``tpot``: a decode step, one token's forward over the context, the work of the
    prompt's last token, which vLLM computes itself in a hit, inside ``vllm``)."""
    out = {part: _median(m.timings.get(part) for m in hits) for part in TIMINGS}
    out["recompute_whole"] = _median(m.recompute_whole_ms for m in hits)
    out["vllm"] = _median(
        m.served.ttft_s * 1e3 - sum(m.timings.values())
        for m in hits
        if all(part in m.timings for part in parts)
    )
    out["tpot"] = _median_tpot_ms(m.served for m in hits)
    return out


def _per_layer(hits: list[Measured]) -> list[float] | None:
    """Per layer of the model, the median over the hits that reported their recompute's
    layers (None: none did)."""
    rows = [m.recompute_layers_ms for m in hits if m.recompute_layers_ms]
    if not rows:
        return None
    return [_median(row[i] for row in rows if i < len(row)) for i in range(max(map(len, rows)))]


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _mean(flags) -> float:
    flags = list(flags)
    return sum(flags) / len(flags) if flags else 0.0


def _correct(text: str, answer: str) -> bool:
    return answer.lower() in text.lower()


def _checked(text: str, answer: str | None) -> bool | None:
    return None if answer is None else _correct(text, answer)


def _gave_donor_value(m: Measured) -> bool | None:
    """Whether the served answer gave the donor's value instead of the target's; None where that
    says nothing: no donor value, or cold got the target's own value wrong (the model could not
    read it even without reuse, so the donor is not to blame)."""
    r = m.request
    if r.donor_answer is None or r.answer is None or not _correct(m.cold.text, r.answer):
        return None
    return _correct(m.served.text, r.donor_answer) and not _correct(m.served.text, r.answer)


def _donor_values(rows: list[Measured]) -> dict[str, int | None]:
    """Served answers that gave the donor's value, out of the targets cold answered right."""
    judged = [g for g in map(_gave_donor_value, rows) if g is not None]
    if not any(m.request.donor_answer for m in rows):
        return {"donor_value_answers": None, "donor_value_cold_right": None}
    return {"donor_value_answers": sum(judged), "donor_value_cold_right": len(judged)}


def request_rows(results: list[Measured]) -> list[dict]:
    return [
        {
            "workload": m.request.workload,
            "group": m.request.group,
            "level": m.request.level,
            "answer": m.request.answer,
            "donor_answer": m.request.donor_answer,
            "cold_correct": _checked(m.cold.text, m.request.answer),
            "semshare_correct": _checked(m.served.text, m.request.answer),
            "semshare_gave_donor_value": _gave_donor_value(m),
            "prompt_tokens": m.prompt_tokens,
            "connector_tokens": m.connector_tokens,
            "vllm_cached": m.vllm_cached,
            "declined": m.declined,
            "cached_tokens": m.served.cached_tokens,
            "hit": m.hit,
            "cold_ttft_ms": m.cold.ttft_s * 1e3,
            "semshare_ttft_ms": m.served.ttft_s * 1e3,
            "cold_e2el_ms": m.cold.total_s * 1e3,
            "semshare_e2el_ms": m.served.total_s * 1e3,
            "cold_output": m.cold.text,
            "semshare_output": m.served.text,
            "noise_output": None if m.noise is None else m.noise.text,
            "reference_nll_cold": m.cold_nll,
            "reference_nll_semshare": m.served_nll,
            "reference_connector_tokens": m.scored_tokens,
            "reference_tokens": m.reference_tokens,
            "perplexity_ratio": m.perplexity_ratio,
            "recompute_share": m.recompute_share,
            "escalated": m.escalated,
            "escalations": m.escalations,
            "gate_residual": m.gate_residual,
            "timings_ms": m.timings or None,
            "recompute_whole_ms": m.recompute_whole_ms,
            "recompute_layers_ms": m.recompute_layers_ms,
        }
        for m in results
    ]


def _pooled_perplexity_ratio(hits: list[Measured]) -> float | None:
    """Perplexity after a hit over perplexity cold of the hits' references as one text: the
    exponential of the token-weighted mean NLL difference (None: none was scored)."""
    scored = [m for m in hits if m.perplexity_ratio is not None and m.reference_tokens > 0]
    tokens = sum(m.reference_tokens for m in scored)
    if not tokens:
        return None
    excess = math.fsum(m.reference_tokens * (m.served_nll - m.cold_nll) for m in scored)
    return math.exp(excess / tokens)


def _perplexity_cell(s: dict) -> str:
    median, pooled = s["perplexity_ratio_hits"], s.get("perplexity_ratio_pooled_hits")
    return "-" if median is None else f"{median:.3f} / {_fmt(pooled, '.3f')}"


def _fmt(value, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def table(summaries: dict[int, dict[str, dict]]) -> str:
    """A console table: one row per context length and workload."""
    lines = [
        "| context | workload | targets | hit rate | vLLM's cache | declined (TTFT / cold) "
        "| cold TTFT | hit TTFT "
        "| hit-only speed-up | blended | miss overhead | ROUGE-L (hits) | ROUGE-L noise floor "
        "| hits as cold (lowest ROUGE-L) | PPL ratio (hits: median / pooled) "
        "| accuracy (served / cold) | donor value (of cold right) | recompute share (hits) "
        "| escalated (hits) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for tokens, by_workload in summaries.items():
        for name, s in by_workload.items():
            acc = (
                "-"
                if s["accuracy_semshare"] is None
                else f"{s['accuracy_semshare']:.0%} / {s['accuracy_cold']:.0%}"
            )
            lines.append(
                f"| {tokens:,} | {name} | {s['targets']} | {s['hit_rate']:.0%} | "
                f"{_fmt(s.get('vllm_cache_rate'), '.0%')} | "
                f"{_declined_cell(s)} | "
                f"{_fmt(s['cold'].get('median_ttft_ms'), '.0f', ' ms')} | "
                f"{_fmt(s['semshare_hits'].get('median_ttft_ms'), '.0f', ' ms')} | "
                f"{_fmt(s['hit_only_speedup'], '.2f', 'x')} | "
                f"{_fmt(s['blended_speedup'], '.2f', 'x')} | "
                f"{_fmt(s['miss_overhead'], '+.1%')} | {_fmt(s['rouge_l_hits'], '.2f')} | "
                f"{_fmt(s['rouge_l_noise_floor'], '.2f')} | "
                f"{_as_cold_cell(s)} | "
                f"{_perplexity_cell(s)} | {acc} | {_donor_cell(s)} | "
                f"{_fmt(s.get('recompute_share_hits'), '.2f')} | "
                f"{_fmt(s.get('escalation_rate_hits'), '.0%')} |"
            )
    return "\n".join(lines)


def breakdown_table(summaries: dict[int, dict[str, dict]]) -> str:
    """Where the time went: one row per context length and workload with hits (medians
    over its hits; "vLLM & rest" is the hit's TTFT less the parts the connector reports; "TPOT",
    a decode step, is about what vLLM's own forward of the prompt's last token costs inside it;
    then ``ceiling`` for the hits' recompute share, and the share of it their speed-up reached);
    and one per context length and workload with declined loads, and one with misses (medians
    over those, their TTFT in the first column: their "vLLM & rest" holds vLLM's computation of
    the prompt)."""
    lines = [
        "| context | workload | TTFT | waiting for search | waiting for alignment | load | "
        "recompute | of which layers run whole | vLLM & rest | TPOT (a decode step) | "
        "ceiling for the share | of it |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for tokens, by_workload in summaries.items():
        for name, s in by_workload.items():
            b = s.get("breakdown_hits_ms") or {}
            known = any(v is not None for v in b.values()) or s.get("ceiling_hits") is not None
            if s["hits"] and known:
                top = _fmt(s.get("ceiling_hits"), ".1f", "x")
                reached = _fmt(s.get("of_ceiling_hits"), ".2f")
                cells = _breakdown_cells(b, s["semshare_hits"])
                lines.append(f"| {tokens:,} | {name} | {cells} | {top} | {reached} |")
            for kind in ("declined", "misses"):
                b = s.get(f"breakdown_{kind}_ms")
                if b and b["search"] is not None:  # (a server that reports them)
                    cells = _breakdown_cells(b, s[f"semshare_{kind}"])
                    label = "missed" if kind == "misses" else kind
                    lines.append(f"| {tokens:,} | {name}, {label} | {cells} | - | - |")
    return "\n".join(lines)


def _breakdown_cells(b: dict, ttft: dict) -> str:
    parts = (*TIMINGS, "recompute_whole", "vllm", "tpot")
    cells = " | ".join(_fmt(b.get(k), ".0f", " ms") for k in parts)
    return f"{_fmt(ttft.get('median_ttft_ms'), '.0f', ' ms')} | {cells}"


def layers_table(summaries: dict[int, dict[str, dict]]) -> str:
    """The hits' recompute by layer of the model: one row per context length and workload
    with hits that reported it (medians over its hits, ms, layer 0 first)."""
    lines = ["| context | workload | recompute per layer, ms (layer 0, 1, ...) |", "|---|---|---|"]
    for tokens, by_workload in summaries.items():
        for name, s in by_workload.items():
            layers = s.get("recompute_layers_hits_ms")
            if layers:
                cells = " ".join(_fmt(ms, ".0f") for ms in layers)
                lines.append(f"| {tokens:,} | {name} | {cells} |")
    return "\n".join(lines)


def _declined_cell(s: dict) -> str:
    if not s.get("declined"):
        return "-"
    return f"{s['declined']} ({s['declined_cost']:.2f}x)"


def _as_cold_cell(s: dict) -> str:
    if s.get("as_cold_hits") is None:
        return "-"
    return f"{s['as_cold_hits']} / {s['hits']} ({s['rouge_l_hits_min']:.2f})"


def _donor_cell(s: dict) -> str:
    if s.get("donor_value_answers") is None:
        return "-"
    return f"{s['donor_value_answers']} / {s['donor_value_cold_right']}"


def write_json(
    path: str | Path,
    config: dict,
    summaries: dict[int, dict[str, dict]],
    rows: dict[int, list[dict]],
    complete: bool,
) -> None:
    Path(path).write_text(
        json.dumps(
            {
                "config": config,
                "complete": complete,
                "results": {
                    str(tokens): {"workloads": summaries[tokens], "requests": rows[tokens]}
                    for tokens in summaries
                },
            },
            indent=1,
        )
    )


def plots(directory: str | Path, summaries: dict[int, dict[str, dict]]) -> list[Path]:
    """TTFT cold vs hit against context length (lines) and per workload at each size (bars,
    with the speed-up), and fidelity against edit ratio (PNG)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    names = sorted({n for by in summaries.values() for n in by})
    fig, ax = plt.subplots(figsize=(7, 4.5))
    lengths = sorted(summaries)
    for name in names:
        cold = [summaries[t].get(name, {}).get("cold", {}).get("median_ttft_ms") for t in lengths]
        hit = [
            summaries[t].get(name, {}).get("semshare_hits", {}).get("median_ttft_ms")
            for t in lengths
        ]
        line = ax.plot(
            lengths, [c if c is not None else np.nan for c in cold], "o--", label=f"{name} cold"
        )[0]
        ax.plot(
            lengths,
            [h if h is not None else np.nan for h in hit],
            "o-",
            color=line.get_color(),
            label=f"{name} hit",
        )
    ax.set_xlabel("prompt tokens (requested context)")
    ax.set_ylabel("median TTFT (ms)")
    written.append(_save(plt, fig, ax, "TTFT, cold vs hit", directory / "ttft_vs_context.png"))
    for tokens in lengths:  # at one size a line is a dot: bars, the speed-up written on them
        written.append(_bars(plt, summaries[tokens], tokens, directory))
    edits = {
        t: by["edit"]["by_edit_level"]
        for t, by in summaries.items()
        if "edit" in by and "by_edit_level" in by["edit"]
    }
    if edits:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for tokens, by_level in edits.items():
            levels = sorted(by_level, key=float)
            ax.plot(
                [float(lv) for lv in levels],
                [by_level[lv]["rouge_l"] for lv in levels],
                "o-",
                label=f"ROUGE-L, {tokens} tokens",
            )
            ax.plot(
                [float(lv) for lv in levels],
                [by_level[lv]["hit_rate"] for lv in levels],
                "s--",
                label=f"hit rate, {tokens} tokens",
            )
        ax.set_xlabel("share of sentences removed or replaced")
        ax.set_ylim(0, 1.05)
        written.append(
            _save(plt, fig, ax, "fidelity against edit ratio", directory / "fidelity_vs_edit.png")
        )
    return written


def _bars(plt, by_workload: dict[str, dict], tokens: int, directory: Path) -> Path:
    """Cold and hit median TTFT side by side per workload at one context size, each pair
    under its hit-only speed-up."""
    names = list(by_workload)
    cold = [by_workload[n]["cold"].get("median_ttft_ms") or 0.0 for n in names]
    hit = [by_workload[n]["semshare_hits"].get("median_ttft_ms") or 0.0 for n in names]
    x = np.arange(len(names))
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(names) + 2), 4.5))
    ax.bar(x - 0.2, cold, 0.4, label="cold")
    ax.bar(x + 0.2, hit, 0.4, label="hit")
    for i, name in enumerate(names):
        speedup = by_workload[name].get("hit_only_speedup")
        label = "no hit" if speedup is None else f"{speedup:.2f}x"
        ax.annotate(label, (x[i], max(cold[i], hit[i])), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(x, names, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("median TTFT (ms)")
    ax.set_ylim(0, 1.15 * max(cold + hit + [1.0]))
    path = directory / f"ttft_by_workload_{tokens}.png"
    return _save(plt, fig, ax, f"TTFT at {tokens:,} tokens, cold vs hit", path)


def _save(plt, fig, ax, title: str, path: Path) -> Path:
    ax.set_title(f"semshare-bench: {title}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
