"""Echoes: aligned tokens that repeat a rare token pair of the text the prompts do not share
(the passage naming what another question asks about), always recomputed on semantic loads."""

import numpy as np
from support.tokens import random_id_list as tokens

from semshare_vllm.alignment import AlignParams, align, with_echoes
from semshare_vllm.alignment.echoes import MAX_REPEATS, echo_starts
from semshare_vllm.config import SemShareConfig
from semshare_vllm.recompute.policy import always_recompute, echo_spans
from semshare_vllm.scheduler.planner import Aligner, plan_claim

ENTITY_T, ENTITY_D = [7001, 7002], [8001, 8002]  # what each prompt's question names
COMMON = [9001, 9002]  # a pair the passages use often


def prompts():
    """A question naming an entity, passages, the question again (doc-qa's shape): the target
    asks about ENTITY_T, the donor about ENTITY_D; the passages name both, once each."""
    a, b, c = tokens(60, 1), tokens(60, 2), tokens(60, 3)
    passages = a + ENTITY_T + b + ENTITY_D + c + COMMON * (MAX_REPEATS + 1)
    target = tokens(5, 4) + ENTITY_T + tokens(3, 5) + passages + tokens(5, 4) + ENTITY_T
    donor = tokens(5, 6) + ENTITY_D + tokens(3, 7) + passages + tokens(5, 6) + ENTITY_D
    return target, donor, 10 + len(a), 10 + len(a) + 2 + len(b)


def test_the_passages_naming_either_question_s_entity_are_echoes():
    target, donor, at_t, at_d = prompts()
    al = with_echoes(align(target, donor, AlignParams(stages=("exact",))), target, donor)
    assert al.donor_pos[at_t] >= 0 and al.donor_pos[at_d] >= 0  # the passages are shared
    # the target's entity echoes its own question; the donor's echoes the donor's question
    assert list(al.echoes) == [at_t, at_d]
    assert np.array_equal(
        al.echoes, echo_starts(np.array(target), np.array(donor), al.donor_pos, al.kind)
    )


def test_a_pair_common_in_the_shared_text_is_no_echo():
    target, donor, at_t, at_d = prompts()
    # the donor's question now also holds the common pair: it stays common, not an echo
    donor = donor[:5] + COMMON + donor[5:]
    al = with_echoes(align(target, donor, AlignParams(stages=("exact",))), target, donor)
    assert set(al.echoes) == {at_t, at_d}


def test_identical_prompts_have_no_echo_and_short_ones_none_either():
    t = tokens(200, 9)
    assert len(with_echoes(align(t, t, AlignParams(stages=("exact",))), t, t).echoes) == 0
    one = np.array([5])
    assert len(echo_starts(one, one, np.array([0]), np.array([1], dtype=np.int8))) == 0


def test_an_echo_and_the_span_after_it_are_always_recomputed_within_the_load():
    echoes = np.array([3, 40])
    got = always_recompute(np.arange(10, 50), None, None, 0, 0, echoes, echo_span=4)
    assert list(got) == list(range(40, 46))  # the pair and 4 after; position 3 is not loaded
    assert len(always_recompute(np.arange(50), None, None, 0, 0, echoes, echo_span=0)) == 0


def test_the_plan_recomputes_echoes_only_with_a_span():
    target, donor, at_t, at_d = prompts()
    al = with_echoes(align(target, donor, AlignParams(stages=("exact",))), target, donor)
    end = len(target) - 1
    with_span = set(plan_claim("k", al, 0, end, 4, 1, echo_span=6).always)
    without = set(plan_claim("k", al, 0, end, 4, 1).always)
    echoed = set(range(at_t, at_t + 8)) | set(range(at_d, at_d + 8))
    assert echoed <= with_span and not (echoed & without)
    assert with_span - without == echoed


def test_only_what_came_before_a_token_makes_it_an_echo():
    """A token's KV reads only what precedes it: a mention that comes after, in the target or
    in the donor (its own answer copying a passage), changes nothing there."""
    a, b = tokens(80, 20), tokens(80, 21)
    target = tokens(10, 22) + a + ENTITY_T + b + tokens(6, 23) + ENTITY_T
    donor = tokens(10, 24) + a + ENTITY_T + b + tokens(6, 25) + ENTITY_D + ENTITY_T
    al = with_echoes(align(target, donor, AlignParams(stages=("exact",))), target, donor)
    assert al.donor_pos[10 + len(a)] >= 0
    assert len(al.echoes) == 0


def test_the_donor_s_entity_counts_when_another_stage_pairs_it_with_the_target_s():
    """The edit stage may align the donor question's entity to the target's (another token):
    the donor's mention is still text the target does not share."""
    a = tokens(80, 30)
    question = tokens(6, 31)
    target = question + ENTITY_T + tokens(4, 32) + a + ENTITY_D + tokens(80, 33)
    donor = question + ENTITY_D + tokens(4, 32) + a + ENTITY_D + tokens(80, 33)
    al = with_echoes(align(target, donor, AlignParams(stages=("exact", "edit"))), target, donor)
    at = len(question) + 2 + 4 + len(a)
    assert al.donor_pos[at] >= 0
    assert at in set(al.echoes)


def test_a_pair_repeated_more_than_max_repeats_times_is_common_text():
    def echoes(repeats):
        body = []
        for i in range(repeats):
            body += tokens(30, 40 + i) + ENTITY_T
        target = tokens(5, 50) + ENTITY_T + tokens(3, 51) + body
        donor = tokens(5, 52) + tokens(3, 53) + body
        return with_echoes(
            align(target, donor, AlignParams(stages=("exact",))), target, donor
        ).echoes

    assert len(echoes(MAX_REPEATS)) == MAX_REPEATS
    assert len(echoes(MAX_REPEATS + 1)) == 0


def test_only_the_chosen_donor_gets_its_echoes_and_only_when_the_span_is_on(monkeypatch):
    """Echoes cost milliseconds at 8K tokens per donor: the aligner marks them on the winner
    alone, and not at all with ``recompute_echo_span`` 0 (off)."""
    from semshare_vllm.alignment import echoes

    calls = []
    counted = echoes.echo_starts
    monkeypatch.setattr(echoes, "echo_starts", lambda *a: calls.append(1) or counted(*a))
    target, donor, at_t, at_d = prompts()
    other = tokens(len(donor), 60)
    off = Aligner(AlignParams(stages=("exact",)), None, None)
    on = Aligner(AlignParams(stages=("exact",)), None, None, echoes=True)
    assert len(align(target, donor, AlignParams(stages=("exact",))).echoes) == 0
    assert off.best(target, 0, [("o", other), ("d", donor)])[0] == "d"
    assert len(off.best(target, 0, [("d", donor)])[1].echoes) == 0
    assert not calls
    key, al = on.best(target, 0, [("o", other), ("d", donor)])
    assert key == "d" and list(al.echoes) == [at_t, at_d] and len(calls) == 1


def test_echo_spans_overlap_and_clip_to_the_load():
    got = always_recompute(np.arange(5, 30), None, None, 0, 0, np.array([2, 8, 10, 40]), 3)
    # [2, 7) -> 5, 6; [8, 13) and [10, 15) -> 8..14; 40 lies past the load
    assert list(got) == [5, 6, *range(8, 15)]
    big = always_recompute(np.arange(100), None, None, 0, 0, np.arange(0, 100, 7), 4096)
    assert list(big) == list(range(100))


def test_past_their_share_of_the_load_every_echo_s_span_is_shortened_alike():
    """On a short prompt with several echoes, full spans made a quarter of the load always
    recomputed (a 512-token hit turned into a decline): the spans shrink together until they
    fit ``max_share``, each echo keeping its pair and first tokens."""
    loaded, echoes = np.arange(200), np.array([10, 60, 110, 160])
    assert len(echo_spans(loaded, echoes, 24)) == 4 * 26  # no cap: 52% of the load
    got = echo_spans(loaded, echoes, 24, max_share=0.25)  # 50 positions: spans of 10 (12 each)
    assert list(got) == [p for e in echoes for p in range(e, e + 12)]
    assert len(echo_spans(loaded, echoes, 24, max_share=0.5)) == 4 * 25
    # the pairs alone still fit at 4%; at 3% the first of their positions that fit
    assert list(echo_spans(loaded, echoes, 24, max_share=0.04)) == [
        p for e in echoes for p in (e, e + 1)
    ]
    assert list(echo_spans(loaded, echoes, 24, max_share=0.03)) == [10, 11, 60, 61, 110, 111]
    # the budget is a share of the load, not of the prompt (100 loaded: 20 positions)
    assert list(echo_spans(np.arange(100, 200), echoes, 24, 0.2)) == [
        *range(110, 120),
        *range(160, 170),
    ]
    # under the cap nothing changes
    assert list(echo_spans(np.arange(100, 200), echoes, 4, 0.2)) == [
        *range(110, 116),
        *range(160, 166),
    ]


def test_the_plan_caps_the_echoes_share_as_configured():
    target, donor, at_t, at_d = prompts()
    al = with_echoes(align(target, donor, AlignParams(stages=("exact",))), target, donor)
    end = len(target) - 1
    without = set(plan_claim("k", al, 0, end, 4, 1).always)
    full = set(plan_claim("k", al, 0, end, 4, 1, 24, 1.0).always) - without
    share = SemShareConfig().recompute_echo_max_share
    capped = set(plan_claim("k", al, 0, end, 4, 1, 24, share).always) - without
    assert len(full) == 2 * 26 and share == 0.1  # 20 of the 208 loaded: spans of 8
    assert capped == {*range(at_t, at_t + 10), *range(at_d, at_d + 10)}
