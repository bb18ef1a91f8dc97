"""Exact-run alignment: shifted documents, reordered passages, repeated text, real prompts."""

import numpy as np
import pytest
from support.tokens import random_id_list as tokens

from semshare_vllm.alignment.exact_runs import align_exact, find_runs
from semshare_vllm.alignment.result import MatchKind, Run

RNG = np.random.default_rng(0)


def check_exact(al, target, donor):
    """Every aligned position really holds the same token as its donor position."""
    t, d = np.asarray(target), np.asarray(donor)
    assigned = np.flatnonzero(al.donor_pos >= 0)
    assert np.array_equal(t[assigned], d[al.donor_pos[assigned]])
    assert np.array_equal(al.kind == MatchKind.EXACT, al.donor_pos >= 0)


def test_shifted_document():
    doc = tokens(500, 1)
    donor = tokens(37, 2) + doc + tokens(20, 3)
    target = tokens(90, 4) + doc
    al = align_exact(target, donor)
    check_exact(al, target, donor)
    assert al.runs == (Run(90, 37, 500),)
    assert al.exact_coverage == pytest.approx(500 / 590)


def test_reordered_passages():
    passages = [tokens(100 + 10 * i, 10 + i) for i in range(5)]
    donor = [t for p in passages for t in p]
    order = [3, 0, 4, 2, 1]  # no two passages stay neighbours
    target = tokens(12, 99) + [t for i in order for t in passages[i]]
    al = align_exact(target, donor)
    check_exact(al, target, donor)
    assert al.num_runs == 5
    starts = np.cumsum([0] + [len(p) for p in passages])
    for run, i in zip(al.runs, order):  # each passage finds its own donor span
        assert run.donor_start == starts[i] and run.length == len(passages[i])


def test_repeated_text_stays_monotone_where_it_can():
    a, s, b = tokens(60, 1), tokens(40, 2), tokens(60, 3)
    donor = a + s + b + s  # s twice in the donor
    target = b + [7] + s  # b, then s: the s that follows b in the donor
    al = align_exact(target, donor)
    check_exact(al, target, donor)
    assert [r.donor_start for r in al.runs] == [100, 160]
    target = [7] + s + [8] + a  # s first, nothing left of it: earliest copy
    assert align_exact(target, donor).runs[0].donor_start == 60


def test_repeated_text_in_the_target_reuses_one_donor_span():
    s = tokens(50, 5)
    donor = tokens(30, 6) + s
    target = s + tokens(10, 7) + s
    al = align_exact(target, donor)
    check_exact(al, target, donor)
    assert [(r.target_start, r.donor_start) for r in al.runs] == [(0, 30), (60, 30)]


def test_overlapping_runs_take_each_position_once():
    x = tokens(80, 8)
    donor = x[:50] + tokens(5, 9) + x[30:]  # x's middle appears on two diagonals
    target = x
    al = align_exact(target, donor, min_len=16)
    check_exact(al, target, donor)
    assert al.coverage == 1.0
    assert sum(r.length for r in al.runs) == len(target)


def test_min_len_and_no_match():
    donor = tokens(200, 11)
    target = donor[50:65] + tokens(100, 12)  # 15 common tokens
    assert find_runs(target, donor, min_len=16) == []
    assert len(find_runs(target, donor, min_len=8)) == 1
    empty = align_exact(tokens(10, 13), donor)
    assert empty.coverage == 0 and (empty.donor_pos == -1).all() and empty.num_runs == 0
    assert align_exact([], donor).coverage == 0


def test_real_cross_instruction_pair():
    """The same real article behind two prompts, tokenised by SmolLM2's tokenizer: the article
    aligns as one run (token boundaries at its edges may differ)."""
    from semshare_vllm.testbed.models import smollm2_tokenizer
    from semshare_vllm.testbed.pairs import DONOR_TEMPLATES, TARGET_TEMPLATES
    from semshare_vllm.testbed.text import wiki_document

    tok = smollm2_tokenizer()
    doc = wiki_document(400, 3000)
    donor = tok(DONOR_TEMPLATES[0].replace("{doc}", doc))["input_ids"]
    target = tok(TARGET_TEMPLATES[1].replace("{doc}", doc))["input_ids"]
    al = align_exact(target, donor)
    check_exact(al, target, donor)
    doc_tokens = len(tok(doc)["input_ids"])
    assert al.exact_coverage * len(target) >= doc_tokens - 4
