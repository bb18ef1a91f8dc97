"""Semantic-hit planning without an engine: the donor choice, the claim plan, per-request
control."""

import types

import numpy as np
from support.tokens import random_id_list as tokens

from semshare_vllm.alignment import AlignParams, align
from semshare_vllm.scheduler.planner import Aligner, coverage, plan_claim
from semshare_vllm.scheduler.request_params import reuse_mode


def test_aligner_picks_the_donor_covering_most_of_the_claim():
    doc = tokens(300, 1)
    target = tokens(20, 2) + doc + tokens(5, 3)
    half = tokens(40, 4) + doc[:150] + tokens(150, 5)
    whole = tokens(7, 6) + doc
    aligner = Aligner(AlignParams(stages=("exact", "edit")), None, None)
    key, al = aligner.best(target, 0, [("half", half), ("whole", whole), ("none", tokens(300, 7))])
    assert key == "whole"
    assert coverage(al, 0, len(target) - 1) > 0.9


def test_plan_claims_the_span_and_always_redoes_what_cannot_be_right():
    doc = tokens(200, 8)
    donor = tokens(10, 9) + doc
    target = tokens(30, 10) + doc + tokens(12, 11)
    al = align(target, donor, AlignParams(stages=("exact",)))
    plan = plan_claim("k", al, 0, len(target) - 1, run_head=4, tail=3)
    assert (plan.start, plan.end) == (0, len(target) - 1)
    assert plan.donor_pos[30:230] == list(range(10, 210))
    assert plan.exact_tokens == 200 and plan.fuzzy_tokens == 0
    always = set(plan.always)
    assert set(range(30)) <= always  # unaligned head
    assert {30, 31, 32, 33} <= always and 34 not in always  # the run's first tokens
    assert set(range(len(target) - 4, len(target) - 1)) <= always  # the tail
    short = plan.truncated(100)
    assert short.end == 100 and len(short.donor_pos) == 100 and max(short.always) == 99


def test_every_stretch_of_aligned_positions_has_its_head_redone_not_only_the_exact_runs():
    """The LSH and sentence stages align same tokens outside any run (a lone newline of another
    instruction taking the donor's newline after other words): such a token attended to other
    tokens in the donor, like a run's first tokens, so its donor KV is redone in every layer.
    Measured on the bench's 2K cross-instruction pair: served without this, the greedy output
    parted from cold's at its first token (8.5% recomputed, the gate passed it)."""
    from semshare_vllm.alignment.result import Alignment, MatchKind, Run

    n = 60
    donor_pos = np.full(n, -1, dtype=np.int64)
    kind = np.zeros(n, dtype=np.int8)
    donor_pos[5:45] = np.arange(105, 145)  # the document: one exact run
    kind[5:45] = MatchKind.EXACT
    donor_pos[50] = 7  # a lone same-token match (LSH): the donor's token 7
    donor_pos[52:55] = [300, 301, 302]  # a same-token stretch a sentence stage aligned
    kind[[50, 52, 53, 54]] = MatchKind.EXACT
    al = Alignment(donor_pos, kind, (Run(5, 105, 40),))
    plan = plan_claim("k", al, 0, n - 1, run_head=2, tail=1)
    always = set(plan.always)
    assert {5, 6} <= always and 7 not in always  # the run's head only
    assert 50 in always  # the lone match
    assert {52, 53} <= always and 54 not in always  # the stretch's head


def test_reuse_mode_reads_kv_transfer_params():
    req = types.SimpleNamespace(kv_transfer_params=None)
    assert reuse_mode(req) == "auto"
    for mode in ("off", "exact", "semantic", "auto"):
        req.kv_transfer_params = {"semshare": mode}
        assert reuse_mode(req) == mode
    req.kv_transfer_params = {"semshare": "bogus"}
    assert reuse_mode(req) == "auto"
    assert reuse_mode(types.SimpleNamespace()) == "auto"


def test_aligner_keeps_donor_features_for_recent_donors():
    aligner = Aligner(AlignParams(stages=("exact",)), None, None)
    donor = tokens(100, 12)
    first = aligner._features("d", donor)
    assert aligner._features("d", donor) is first
    for i in range(300):
        aligner._features(f"other-{i}", donor)
    assert aligner._features("d", donor) is not first  # evicted (LRU, 256 kept)


def test_a_donors_features_follow_the_prompt_length_it_is_aligned_by():
    """One donor id (a hash of its tokens) can come with two prompt lengths: restored from
    disk it keeps none (all its tokens are its prompt), captured again it does. Features kept
    from the longer list aligned target tokens past the shorter prompt, where the echoes'
    search (the donor's pairs) then indexed past its end: a discovery fault, the hit lost."""
    prompt, reply = tokens(200, 13), tokens(40, 14)
    target = tokens(5, 15) + prompt + reply + tokens(5, 16)
    aligner = Aligner(AlignParams(stages=("exact",)), None, None, echoes=True)
    aligner.prepare("d", prompt + reply)  # restored: every token its prompt
    _, al = aligner.best(target, 0, [("d", prompt)])  # captured again: the prompt alone
    assert int(al.donor_pos.max()) == len(prompt) - 1
    _, al = aligner.best(target, 0, [("d", prompt + reply)])
    assert int(al.donor_pos.max()) == len(prompt + reply) - 1


def test_warming_up_runs_every_alignment_stage(monkeypatch):
    """At start-up the aligner runs each stage once, so the first hit after a server starts
    pays none of their one-time costs (the sentence stage's common directions, the LSH stage's
    FAISS import and angle table): on a fresh `vllm serve` those cost 220 ms, past the 200 ms
    lookup deadline, and 3 first semantic targets of 3 were misses."""
    import importlib

    from semshare_vllm.testbed.models import smollm2

    # (the module: the package exports a function of the same name)
    align_module = importlib.import_module("semshare_vllm.alignment.align")

    ran = []
    for name in ("edit_stage", "sentence_stage", "lsh_stage"):
        stage = getattr(align_module, name)
        monkeypatch.setattr(
            align_module, name, lambda *a, _s=stage, _n=name, **k: ran.append(_n) or _s(*a, **k)
        )
    model = str(smollm2())
    aligner = Aligner(AlignParams(), model, model)
    aligner.warm()
    assert ran == ["edit_stage", "sentence_stage", "lsh_stage"]
    assert "common_directions" in vars(aligner.table)  # computed, kept
