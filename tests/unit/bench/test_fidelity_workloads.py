"""`semshare-bench`'s held-out fidelity workloads (rag-qa, entity-swap, chat-instruction), built
from real text with the served model's tokenizer at 512, 2K and 8K tokens, and the report's count
of served answers that gave the donor's value."""

import json

import pytest

from semshare_vllm.bench import cli, report
from semshare_vllm.bench import workloads as W
from semshare_vllm.bench.client import Completion
from semshare_vllm.bench.measure import Measured
from semshare_vllm.testbed import pairs as P
from semshare_vllm.testbed.models import smollm2_tokenizer

SIZES = (512, 2048, 8192)


@pytest.fixture(scope="module")
def sizer():
    return W.Sizer(smollm2_tokenizer())


def _by_group(reqs):
    groups = {}
    for r in reqs:
        groups.setdefault(r.group, []).append(r)
    return [
        ([r for r in rs if r.role == "donor"], [r for r in rs if r.role == "target"])
        for rs in groups.values()
    ]


def _within(sizer, prompt, tokens, share=0.15):
    return abs(sizer.count(prompt) - tokens) <= share * tokens


@pytest.mark.parametrize("tokens", SIZES)
def test_rag_qa_reorders_passages_and_asks_what_one_states(sizer, tokens):
    reqs = W.build("rag-qa", 3, tokens, sizer, seed=1)
    assert all(_within(sizer, r.prompt, tokens) for r in reqs)
    facts = P.fact_passages()
    for donors, targets in _by_group(reqs):
        [donor] = donors
        assert donor.answer is None and 1 <= len(targets) <= W.MAX_QUESTIONS
        donor_passages = donor.prompt.split("\n\n[1] ", 1)[1]
        for t in targets:
            question = t.prompt.rsplit("Question: ", 1)[1].split("\n")[0]
            assert (question, t.answer) in P.FACT_VALUE_QUESTIONS
            _assert_states_the_answer(sizer, t)
            # the passage that states the answer is in the target, whole, and in the donor too
            stating = facts[P.fact_title(question)]
            assert t.answer in stating and stating in t.prompt and stating in donor.prompt
            # the same passages (titles and bodies), in another order, under another header
            target_passages = t.prompt.split("\n\n[1] ", 1)[1]
            assert _passages(donor_passages) != _passages(target_passages)
            assert sorted(_passages(donor_passages)) == sorted(_passages(target_passages))
            assert t.prompt.split("\n")[0] != donor.prompt.split("\n")[0]
        # each target of a group asks its own question over the same bundle
        assert len({t.answer for t in targets}) == len(targets)
        assert len({_passages(t.prompt.split("\n\n[1] ", 1)[1]) for t in targets}) == 1
    if tokens >= 2048:  # room for several fact passages, hence several questions a group
        assert all(len(targets) == W.MAX_QUESTIONS for _, targets in _by_group(reqs))


def _assert_states_the_answer(sizer, target) -> None:
    """A fact target's reference: its answer, then the sentence of its own prompt that states
    it (15 tokens at least: the answer alone is too few for a perplexity ratio)."""
    head = f" {target.answer}. "
    assert target.reference.startswith(head)
    statement = target.reference[len(head) :]
    assert target.answer in statement and statement in target.prompt
    assert sizer.count(target.reference) >= 15


def test_every_fact_question_has_the_sentence_that_states_its_answer():
    facts = P.fact_passages()
    assert set(P.FACT_STATEMENTS) == {q for q, _ in P.FACT_VALUE_QUESTIONS}
    for question, answer in P.FACT_VALUE_QUESTIONS:
        statement = P.FACT_STATEMENTS[question]
        assert answer in statement and statement in facts[P.fact_title(question)]
        assert P.fact_reference(question) == f" {answer}. {statement}"
    swapped = P.fact_reference("Who wrote Candide?", {"Voltaire": "Brandt", "1759": "1771"})
    assert swapped.startswith(" Brandt. ") and "1771" in swapped
    assert "Voltaire" not in swapped and "1759" not in swapped


def test_rag_qa_refuses_a_context_too_small_to_reorder(sizer):
    with pytest.raises(W.WorkloadError, match="nothing to reorder"):
        W.build("rag-qa", 1, 128, sizer)


def _passages(numbered: str) -> tuple[str, ...]:
    """The passages of ``P.passages`` output (the first one's "[1] " already cut off), without
    their numbers or the question after the last one."""
    import re

    body = numbered.rsplit("\n\nQuestion: ", 1)[0]
    return tuple(re.split(r"\n\n\[\d+\] ", body))


@pytest.mark.parametrize("tokens", SIZES)
def test_entity_swap_targets_state_a_value_the_donor_does_not(sizer, tokens):
    reqs = W.build("entity-swap", 3, tokens, sizer, seed=2)
    assert all(_within(sizer, r.prompt, tokens) for r in reqs)
    for donors, targets in _by_group(reqs):
        [donor] = donors
        assert targets and donor.donor_answer is None
        for t in targets:
            assert t.answer and t.donor_answer and t.answer != t.donor_answer
            assert t.answer in t.prompt and t.donor_answer not in t.prompt
            assert t.donor_answer in donor.prompt and t.answer not in donor.prompt
            _assert_states_the_answer(sizer, t)  # the new value, as the target's passage has it
            assert t.donor_answer not in t.reference
            question = t.prompt.rsplit("Question: ", 1)[1].split("\n")[0]
            assert (question, t.donor_answer) in P.FACT_VALUE_QUESTIONS  # it asks what changed
        # the target is the donor's text with values changed (the asked one and maybe others of
        # the group's): mapping every new value back gives the donor's passages exactly
        back = {t.answer: t.donor_answer for t in targets}
        for t in targets:
            text = _fact_document(t.prompt)
            for new, old in back.items():
                text = text.replace(new, old)
            assert text == _fact_document(donor.prompt)
            changed = sum(new in t.prompt for new in back)
            assert 1 <= changed <= 1 + W.SWAP_OTHERS


def _fact_document(prompt: str) -> str:
    """The passages of a ``P.fact_prompt`` prompt (between the two questions)."""
    return prompt.split("\n\n", 1)[1].rsplit("\n\nQuestion: ", 1)[0]


def test_entity_swap_values_are_distinct_from_every_other():
    import random

    donor = "Written by Voltaire in 1759, it ran 742 times; 1771 and Halloway appear here."
    values = ("Voltaire", "1759", "742")
    for seed in range(50):
        new = W._new_values(values, donor, random.Random(seed))
        assert set(new) == set(values)
        assert all(v not in donor for v in new.values())
        assert new["1759"].isdigit() and 3 <= abs(int(new["1759"]) - 1759) <= 40
        assert len(new["742"]) == 3 and new["Voltaire"] in W.SWAP_SURNAMES
        everything = list(values) + list(new.values())
        assert not any(a != b and a in b for a in everything for b in everything)


@pytest.mark.parametrize("tokens", SIZES)
def test_chat_instruction_is_one_document_in_two_chats(sizer, tokens):
    reqs = W.build("chat-instruction", 2, tokens, sizer, seed=0)
    assert all(_within(sizer, r.prompt, tokens, share=0.05) for r in reqs)
    for [donor], [target] in _by_group(reqs):
        # SmolLM2's own chat template: a system turn, a user turn, the assistant's turn opened
        for r in (donor, target):
            assert r.prompt.startswith("<|im_start|>system\n")
            assert r.prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")
        doc = _chat_document(donor.prompt)
        assert sizer.count(doc) > 0.9 * tokens - 60 and doc == _chat_document(target.prompt)
        assert donor.prompt.split("\n")[1] != target.prompt.split("\n")[1]  # other systems
        assert 30 <= sizer.count(target.reference) <= W.REFERENCE_TOKENS + 2
        assert target.reference not in target.prompt


def _chat_document(prompt: str) -> str:
    """The document of a chat-instruction prompt: the user turn less its instruction."""
    user = prompt.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
    instructions = [i for _, i, _ in W.CHAT_DONOR_TURNS + W.CHAT_TARGET_TURNS]
    [instruction] = [i for i in instructions if user.startswith(i) or user.endswith(i)]
    return user.replace(instruction, "").strip("\n")


def test_chat_instruction_without_a_tokenizer_uses_plain_turns():
    reqs = W.build("chat-instruction", 1, 512, W.Sizer())
    for r in reqs:
        assert r.prompt.startswith("System: ") and "\n\nUser: " in r.prompt
        assert r.prompt.endswith("\n\nAssistant:")
        assert abs(len(r.prompt) - 512 * W.CHARS_PER_TOKEN) < 0.1 * 512 * W.CHARS_PER_TOKEN


# ---- the report: donor values among the targets cold got right -----------------------------
def _measured(cold: str, served: str, answer="1985", donor_answer="1949", workload="entity-swap"):
    request = W.BenchRequest(
        workload, "g", "target", "prompt", answer, reference=None, donor_answer=donor_answer
    )
    return Measured(
        request,
        cold=Completion(cold, 0.2, 0.3, 0, 100),
        served=Completion(served, 0.1, 0.2, 0, 100),
        connector_tokens=90,
    )


def test_donor_values_count_only_where_cold_was_right():
    results = [
        _measured("It premiered in 1985.", "It premiered in 1949."),  # leaked: counted
        _measured("1985", "1985"),  # right: judged, not counted
        _measured("1985", "1949 or maybe 1985"),  # holds the target's value too: not counted
        _measured("1949", "1949"),  # cold wrong: the donor is not to blame, not judged
        _measured("I do not know", "1949"),  # cold wrong again
        _measured("Voltaire", "Voltaire", answer="Voltaire", donor_answer=None, workload="rag-qa"),
    ]
    summaries = report.summarize(results)
    swap, rag = summaries["entity-swap"], summaries["rag-qa"]
    assert (swap["donor_value_answers"], swap["donor_value_cold_right"]) == (1, 3)
    assert swap["accuracy_cold"] == pytest.approx(3 / 5)
    assert rag["donor_value_answers"] is None and rag["donor_value_cold_right"] is None
    rows = report.request_rows(results)
    assert [r["semshare_gave_donor_value"] for r in rows] == [True, False, False, None, None, None]
    assert [r["donor_answer"] for r in rows][:2] == ["1949", "1949"]
    assert [r["cold_correct"] for r in rows] == [True, True, True, False, False, True]
    assert rows[0]["semshare_correct"] is False and rows[2]["semshare_correct"] is True
    lines = report.table({512: summaries}).splitlines()
    assert "| accuracy (served / cold) | donor value (of cold right) |" in lines[0]
    assert all(line.count("|") == lines[0].count("|") for line in lines)
    assert lines[2].startswith("| 512 | entity-swap |") and "| 1 / 3 | - | - |" in lines[2]
    assert lines[3].startswith("| 512 | rag-qa |") and "| 100% / 100% | - |" in lines[3]


def test_no_cold_right_target_counts_zero_of_zero():
    summary = report.summarize([_measured("no idea", "1949")])["entity-swap"]
    assert (summary["donor_value_answers"], summary["donor_value_cold_right"]) == (0, 0)


def test_the_json_carries_the_donor_value_figures(tmp_path):
    results = [_measured("1985", "1949")]
    out = tmp_path / "r.json"
    report.write_json(
        out, {}, {512: report.summarize(results)}, {512: report.request_rows(results)}, True
    )
    saved = json.loads(out.read_text())["results"]["512"]
    assert saved["workloads"]["entity-swap"]["donor_value_answers"] == 1
    assert saved["requests"][0]["semshare_gave_donor_value"] is True


# ---- registration and the workload file ------------------------------------------------------
def test_the_new_workloads_are_registered_and_in_all():
    for name in ("rag-qa", "entity-swap", "chat-instruction"):
        assert name in W.WORKLOADS and name in W._BUILDERS
    assert set(W._BUILDERS) == set(W.WORKLOADS)
    args = cli.parse_args(["--base-url", "http://x", "--workloads", "all"])
    assert set(args.workload_names) >= {"rag-qa", "entity-swap", "chat-instruction"}


def test_a_workload_file_may_carry_the_donor_value(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text(
        '{"prompt": "It opened in 1949.", "group": "g", "role": "donor"}\n'
        '{"prompt": "It opened in 1985.", "group": "g", "answer": "1985", "donor_answer": "1949"}\n'
    )
    assert [(r.answer, r.donor_answer) for r in W.load_file(path)] == [
        (None, None),
        ("1985", "1949"),
    ]
    for line, why in [
        ('{"prompt": "p", "answer": "a", "donor_answer": 3}', "'donor_answer' must be"),
        ('{"prompt": "p", "donor_answer": "b"}', "'donor_answer' needs an 'answer'"),
    ]:
        path.write_text('{"prompt": "fine"}\n' + line + "\n")
        with pytest.raises(W.WorkloadError, match=f"line 2: {why}"):
            W.load_file(path)


def test_the_repair_each_hit_got_is_read_from_the_connectors_metrics():
    """Per served request: the provenance histogram's one observation (its recompute share)
    and whether the gate escalated it; per workload, their median and rate over the hits."""
    from semshare_vllm.bench.measure import _repair_figures

    def metrics(share_sum, count, escalated, gates, widenings=None):
        return {
            "served_recompute_share_sum": share_sum,
            "served_recompute_share_count": count,
            "recompute_escalated_loads": escalated,
            "recompute_escalations": escalated if widenings is None else widenings,
            "recompute_gate_checks": gates,
            # the gate's estimate, one observation per gated hit (here 0.01 each)
            "served_gate_residual_sum": 0.01 * gates,
            "served_gate_residual_count": gates,
        }

    a, b, c, d = (_measured("1985", "1985") for _ in range(4))
    _repair_figures(a, {"before": metrics(1.0, 4, 2, 5), "after": metrics(1.2, 5, 2, 6)})
    _repair_figures(b, {"before": metrics(1.2, 5, 2, 6), "after": metrics(2.2, 6, 3, 7)})
    # two shares observed in between: no share is attributed (no gate ran: not known either)
    _repair_figures(c, {"before": metrics(2.2, 6, 3, 7), "after": metrics(3.0, 8, 3, 7)})
    # declined: escalated, and no share observed (vLLM computed it)
    # (its gate widened it once, then declined at the second: where its time went)
    _repair_figures(d, {"before": metrics(3.0, 8, 3, 7), "after": metrics(3.0, 8, 4, 8, 5)})
    assert (a.recompute_share, a.escalated, a.escalations) == (pytest.approx(0.2), False, 0)
    assert (b.recompute_share, b.escalated, b.escalations) == (pytest.approx(1.0), True, 1)
    assert (c.recompute_share, c.escalated, c.escalations) == (None, None, None)
    assert (d.recompute_share, d.escalated, d.escalations) == (None, True, 2)
    assert report.request_rows([d])[0]["escalations"] == 2
    # under tensor parallelism every rank counts (vLLM sums the workers' stats): the same load
    e = _measured("1985", "1985")
    _repair_figures(e, {"before": metrics(3.0, 8, 3, 7), "after": metrics(3.0, 8, 5, 9, 7)})
    assert (e.escalated, e.escalations) == (True, 2)
    # what the gate estimated was left: the hit's one observation of its histogram
    assert (a.gate_residual, b.gate_residual, c.gate_residual) == (
        pytest.approx(0.01),
        pytest.approx(0.01),
        None,
    )
    summary = report.summarize([a, b, c])["entity-swap"]
    assert summary["recompute_share_hits"] == pytest.approx(0.6)
    assert summary["escalation_rate_hits"] == pytest.approx(0.5)
    assert report.table({512: {"entity-swap": summary}}).splitlines()[2].endswith("| 0.60 | 50% |")


def test_each_hits_time_breakdown_is_read_from_the_connectors_metrics():
    """Per served request: one observation of each ``served_<part>_ms`` histogram is its part;
    per workload, the medians over the hits and what is left of the hit's TTFT (vLLM's)."""
    from semshare_vllm.bench.measure import _repair_figures

    def metrics(n, search, align, load, recompute):
        out = {}
        for part, ms in (
            ("search", search),
            ("align", align),
            ("load", load),
            ("recompute", recompute),
        ):
            out[f"served_{part}_ms_sum"], out[f"served_{part}_ms_count"] = ms, n
        return out

    a, b, c = (_measured("1985", "1985") for _ in range(3))  # served TTFT: 100 ms each
    whole = {
        "served_recompute_whole_ms_sum": 30,
        "served_recompute_whole_ms_count": 1,
        # by layer, as Endpoint.counters reads the labelled series
        **{f"served_recompute_layer_ms_sum/{i}": ms for i, ms in enumerate((25, 10, 5))},
        **{f"served_recompute_layer_ms_count/{i}": 1 for i in range(3)},
    }
    _repair_figures(
        a, {"before": metrics(0, 0, 0, 0, 0), "after": {**metrics(1, 5, 4, 10, 40), **whole}}
    )
    _repair_figures(b, {"before": metrics(1, 5, 4, 10, 40), "after": metrics(2, 25, 8, 30, 100)})
    # an exact hit: a search and nothing else (no repair, no alignment)
    _repair_figures(
        c,
        {
            "before": metrics(2, 25, 8, 30, 100),
            "after": {
                **metrics(2, 25, 8, 30, 100),
                "served_search_ms_sum": 26,
                "served_search_ms_count": 3,
            },
        },
    )
    assert a.timings == pytest.approx({"search": 5, "align": 4, "load": 10, "recompute": 40})
    assert b.timings == pytest.approx({"search": 20, "align": 4, "load": 20, "recompute": 60})
    assert c.timings == pytest.approx({"search": 1})
    b.served = Completion("1985", 0.2, 0.3, 0, 100)  # 200 ms
    s = report.summarize([a, b, c])["entity-swap"]
    got = s["breakdown_hits_ms"]
    assert got["search"] == pytest.approx(5) and got["align"] == pytest.approx(4)
    assert (got["load"], got["recompute"]) == (pytest.approx(15), pytest.approx(50))
    # what is left: 100 - 5 - 4 - 10 - 40 = 41 and 200 - 20 - 4 - 20 - 60 = 96 (c: no repair)
    assert got["vllm"] == pytest.approx(68.5)
    # of a's recompute, 30 ms in the layers that ran every position (b, c: not reported)
    assert (a.recompute_whole_ms, b.recompute_whole_ms) == (30, None)
    assert got["recompute_whole"] == pytest.approx(30)
    row = report.breakdown_table({512: {"entity-swap": s}}).splitlines()[2]
    assert row == (
        "| 512 | entity-swap | 100 ms | 5 ms | 4 ms | 15 ms | 50 ms | 30 ms | 68 ms | - | - | - |"
    )
    assert report.request_rows([a])[0]["timings_ms"] == a.timings
    assert report.request_rows([a])[0]["recompute_whole_ms"] == 30
    # by layer: a's (b and c reported none)
    assert (a.recompute_layers_ms, b.recompute_layers_ms) == ([25, 10, 5], None)
    assert s["recompute_layers_hits_ms"] == [25, 10, 5]
    assert report.request_rows([a])[0]["recompute_layers_ms"] == [25, 10, 5]
    assert report.layers_table({512: {"entity-swap": s}}).splitlines()[2] == (
        "| 512 | entity-swap | 25 10 5 |"
    )


def test_the_endpoint_reads_per_layer_histograms_by_layer(monkeypatch):
    from semshare_vllm.bench import client

    text = "\n".join(
        [
            'vllm:semshare_hits_total{engine="0",model_name="m"} 2.0',
            'vllm:semshare_served_recompute_ms_sum{engine="0",model_name="m"} 60.0',
            'vllm:semshare_served_recompute_layer_ms_sum{engine="0",layer="0",model="m"} 40.0',
            'vllm:semshare_served_recompute_layer_ms_sum{engine="0",layer="1",model="m"} 20.0',
            'vllm:semshare_served_recompute_layer_ms_count{engine="0",layer="1",model="m"} 1.0',
            'vllm:semshare_served_recompute_layer_ms_sum{engine="1",layer="1",model="m"} 5.0',
        ]
    )
    monkeypatch.setattr(client.requests, "get", lambda *a, **k: type("R", (), {"text": text})())
    got = client.Endpoint("http://x", model="m").counters()
    assert got == {
        "hits": 2.0,
        "served_recompute_ms_sum": 60.0,
        "served_recompute_layer_ms_sum/0": 40.0,
        "served_recompute_layer_ms_sum/1": 25.0,  # summed over engines
        "served_recompute_layer_ms_count/1": 1.0,
    }


def test_plots_at_one_size_draw_bars_per_workload(tmp_path):
    a, b = _measured("1985", "1985"), _measured("x", "y", workload="rag-qa")
    b.connector_tokens = 0  # a miss: its bars say "no hit"
    written = report.plots(tmp_path, {2048: report.summarize([a, b])})
    names = sorted(p.name for p in written)
    assert names == ["ttft_by_workload_2048.png", "ttft_vs_context.png"]
    assert all(p.stat().st_size > 1000 for p in written)


def test_the_report_counts_the_hits_that_answered_as_cold():
    """A median ROUGE-L of 1.00 hid hits that parted from cold (6 of 36 in one run): the report
    says how many hits gave cold's very text, and the lowest ROUGE-L among them."""
    same = [_measured("It premiered in 1985.", "It premiered in 1985.") for _ in range(3)]
    parted = _measured("It premiered in 1985.", "It premiered in 1985 and closed.")
    other = _measured("It premiered in 1985.", "Nobody knows")
    s = report.summarize([*same, parted, other])["entity-swap"]
    assert s["as_cold_hits"] == 3 and s["rouge_l_hits_min"] == pytest.approx(0.0)
    assert s["rouge_l_hits"] == pytest.approx(1.0)  # the median alone says all is well
    lines = report.table({512: {"entity-swap": s}}).splitlines()
    assert "| hits as cold (lowest ROUGE-L) |" in lines[0]
    assert "| 3 / 5 (0.00) |" in lines[2]
    assert all(line.count("|") == lines[0].count("|") for line in lines)


# ---- the report: the perplexity ratio of the hits' references ------------------------------
def _scored(cold_nll: float, served_nll: float, tokens: int) -> Measured:
    m = _measured("1985", "1985", workload="doc-qa")
    m.cold_nll, m.served_nll, m.scored_tokens, m.reference_tokens = cold_nll, served_nll, 90, tokens
    return m


def test_the_pooled_perplexity_ratio_weighs_every_reference_token_alike():
    """doc-qa's references are its answers, 1-5 tokens each: one by one their ratios scatter
    both ways (1K doc-qa: 0.91 to 1.06), so the median of three says little. Taken as one text
    the hits' references give the workload's perplexity ratio, printed beside the median."""
    import math

    hits = [_scored(1.0, 1.2, 2), _scored(2.0, 2.05, 3), _scored(1.5, 1.49, 20)]
    s = report.summarize(hits)["doc-qa"]
    assert s["perplexity_ratio_hits"] == pytest.approx(math.exp(0.05))  # the median target's
    excess = (2 * 0.2 + 3 * 0.05 - 20 * 0.01) / 25
    assert s["perplexity_ratio_pooled_hits"] == pytest.approx(math.exp(excess))
    assert [r["reference_tokens"] for r in report.request_rows(hits)] == [2, 3, 20]
    lines = report.table({1024: {"doc-qa": s}}).splitlines()
    assert "| PPL ratio (hits: median / pooled) |" in lines[0]
    assert f"| {math.exp(0.05):.3f} / {math.exp(excess):.3f} |" in lines[2]
    # nothing scored: both are missing, and so is the cell
    unscored = report.summarize([_measured("1985", "1985", workload="doc-qa")])["doc-qa"]
    assert unscored["perplexity_ratio_pooled_hits"] is None
    assert "| - | 100% / 100% |" in report.table({1024: {"doc-qa": unscored}}).splitlines()[2]


def test_scoring_keeps_how_many_reference_tokens_each_nll_is_the_mean_of():
    from semshare_vllm.bench import measure

    class Scoring:
        def __init__(self):
            self.lookups = 0

        def counters(self):
            self.lookups += 1
            return {"lookups": self.lookups, "hit_tokens": 90 * (self.lookups > 1)}

        def reference_nll(self, prompt, reference, reuse, cache_salt=None):
            return (1.25 if reuse else 1.0), 4

    m = _measured("1985", "1985", workload="doc-qa")
    measure._score(Scoring(), m, "salt")
    assert (m.cold_nll, m.served_nll, m.reference_tokens, m.scored_tokens) == (1.0, 1.25, 4, 90)


def test_the_breakdown_shows_a_decode_step_beside_what_is_left_of_a_hit():
    """Issue 21 asks the breakdown for the compute vLLM does itself. In a semantic hit that is
    the forward of the prompt's last token: one token over the whole context, a decode step's
    work. 2K cross-instruction hits left 115 ms as "vLLM & rest", of which a decode step took
    84 ms: the part no connector can take out."""
    a, b, c = (_measured("1985", "1985") for _ in range(3))
    a.served = Completion("1985", 0.1, 0.1 + 31 * 0.08, 0, 100, output_tokens=32)  # 80 ms
    b.served = Completion("1985", 0.1, 0.1 + 31 * 0.06, 0, 100, output_tokens=32)  # 60 ms
    c.served = Completion("1985", 0.1, 0.5, 0, 100, output_tokens=1)  # one token: no step
    assert a.served.tpot_s == pytest.approx(0.08) and c.served.tpot_s is None
    assert Completion("1985", 0.1, 0.2, 0, 100).tpot_s is None  # count not reported
    s = report.summarize([a, b, c])["entity-swap"]
    assert s["breakdown_hits_ms"]["tpot"] == pytest.approx(70)
    assert s["semshare_hits"]["median_tpot_ms"] == pytest.approx(70)  # vllm bench serve's name
    lines = report.breakdown_table({512: {"entity-swap": s}}).splitlines()
    assert "| vLLM & rest | TPOT (a decode step) |" in lines[0]
    assert lines[2].endswith("| 70 ms | - | - |")  # (no share reported: no ceiling)
    assert all(line.count("|") == lines[0].count("|") for line in lines)


def test_the_breakdown_reads_the_hits_against_issue_21s_ceiling_for_their_share():
    """Issue 21's target is a hit TTFT of at least 0.8 of the ceiling for the share recomputed:
    L / (1.25 + 0.75r + r(L - 2)), layer 0 whole, layer 1 a quarter (its probe), r of the
    tokens after it. Each run's figure was worked out by hand from the share and the speed-up;
    the bench now reports it (2K cross-instruction on 2026-11-27: share 0.0885 over 30 layers,
    r = 0.023, ceiling 15.6x; 11.47x reached 0.74 of it)."""
    a, b = _measured("1985", "1985"), _measured("1985", "1985")  # cold 200 ms, served 100 ms
    for m, share in ((a, 0.0885), (b, 0.0885)):
        m.recompute_share, m.recompute_layers_ms = share, [1.0] * 30
    s = report.summarize([a, b])["entity-swap"]
    r = (0.0885 * 30 - 2) / 28
    assert s["ceiling_hits"] == pytest.approx(30 / (1.25 + 0.75 * r + r * 28))
    assert s["ceiling_hits"] == pytest.approx(15.6, abs=0.05)
    assert s["of_ceiling_hits"] == pytest.approx(2.0 / s["ceiling_hits"])
    lines = report.breakdown_table({2048: {"entity-swap": s}}).splitlines()
    assert lines[0].endswith("| TPOT (a decode step) | ceiling for the share | of it |")
    assert lines[2].endswith(f"| {s['ceiling_hits']:.1f}x | {s['of_ceiling_hits']:.2f} |")
    assert all(line.count("|") == lines[0].count("|") for line in lines)
    # the layers not reported, or no share (exact hits): no ceiling
    b.recompute_layers_ms = a.recompute_layers_ms = None
    assert report.summarize([a, b])["entity-swap"]["of_ceiling_hits"] is None
    assert report.ceiling(None, 30) is None and report.ceiling(0.0885, None) is None
    # every token-layer recomputed: nothing to gain
    assert report.ceiling(1.0, 30) == pytest.approx(30 / (1.25 + 0.75 + 28))
