"""Recompute policies on hand-made probes."""

import numpy as np
import pytest

from semshare_vllm.config import SemShareConfig
from semshare_vllm.recompute.policy import (
    Adaptive,
    CacheBlend,
    Decline,
    Escalate,
    Fixed,
    LayerProbe,
    SemShareKV,
    always_recompute,
    hot_positions,
    make_selection,
)


def probe(layer, positions, deviation=None, attention=None):
    return LayerProbe(
        layer,
        np.asarray(positions),
        None if deviation is None else np.asarray(deviation, dtype=float),
        attention,
    )


# ---- policies ----------------------------------------------------------------------------------
def test_cacheblend_keeps_the_top_ratio_and_the_always_set_after_the_check_layer():
    loaded = np.arange(10)
    sel = CacheBlend(loaded, always=[0, 9], ratio=0.3, check_layer=1)
    assert np.array_equal(sel.start(), loaded)
    assert sel.wants_probe(0) == (False, False) and sel.after_layer(probe(0, loaded)) is None
    assert sel.wants_probe(1) == (True, False)
    dev = [9, 0, 5, 0, 7, 0, 6, 0, 0, 8]  # highest among the others: 2 (5), 4 (7), 6 (6)
    keep = sel.after_layer(probe(1, loaded, dev))
    assert np.array_equal(loaded[keep], [0, 2, 4, 6, 9])
    assert sel.after_layer(probe(2, loaded[keep], [0] * 5)) is None  # fixed from then on
    assert sel.narrows_at(1) and not sel.narrows_at(0) and not sel.narrows_at(2)
    # a floor on the count: at least 4 besides the always-set, whatever the ratio gives
    floor = CacheBlend(loaded, always=[0, 9], ratio=0.3, check_layer=1, min_tokens=4)
    keep = floor.after_layer(probe(1, loaded, dev))
    assert np.array_equal(loaded[keep], [0, 1, 2, 4, 6, 9])  # the 4th: the first of a tie


def test_semsharekv_splits_hot_and_cold_then_decays():
    loaded = np.arange(20)
    attention = np.zeros(20)
    attention[[3, 7]] = [0.5, 0.3]  # 3 and 7 hold 80% of the attention
    attention[10:] = 0.02
    sel = SemShareKV(
        loaded, always=[19], hot_threshold=0.55, hot_ratio=0.5, cold_ratio=0.25, layer_decay=0.5
    )
    assert sel.wants_probe(0) == (True, True)
    dev = np.arange(20, dtype=float)[::-1]  # position 0 deviates most
    keep = loaded[sel.after_layer(probe(0, loaded, dev, attention))]
    hot = hot_positions(attention, 0.55)
    assert np.array_equal(hot, [3, 7])
    assert 3 in keep and 7 not in keep  # half of the hot: the more deviating one
    cold = [p for p in keep if p not in (3, 7, 19)]
    assert cold == [0, 1, 2, 4]  # 25% of the 17 cold others, by deviation
    assert 19 in keep
    # what the load reports: the mean deviation at layer 0 (sqrt: the probe's is squared) of
    # the 19 positions the donor could serve (19 is always recomputed), and what is left once
    # the kept positions hold their own KV
    root = np.sqrt(dev)
    assert sel.measured == pytest.approx(root[:19].mean())
    assert sel.residual == pytest.approx(root[np.setdiff1d(loaded, keep)].sum() / 19)
    second = sel.after_layer(probe(1, keep, np.ones(len(keep))))
    assert len(second) == 1 + int(np.floor(5 * 0.5))  # always + decayed budget
    assert sel.measured == pytest.approx(root[:19].mean())  # the first measuring layer's only


def adaptive(**kw):
    args = dict(always=[99], bound=0.08, check_layer=1, gate_layer=3, sentinels=0.1, window=4)
    args.update(kw)
    return Adaptive(np.arange(100), **args)


def check_probe(sel):
    """Layer 1 over every candidate: positions 0-9 deviate 0.5 (root), the rest 0.05; the last
    tokens attend to 0-4 only."""
    root = np.full(100, 0.05)
    root[:10] = 0.5
    attention = np.zeros(100)
    attention[:5] = 1.0
    return probe(1, np.arange(100), root**2, attention)


def test_adaptive_keeps_the_weighted_worst_until_the_error_left_is_under_the_bound():
    checked()


def checked():
    """An adaptive selection past its check layer (``check_probe``), checked: it and what it
    carries on."""
    sel = adaptive()
    assert sel.wants_probe(0) == (False, False) and sel.wants_probe(1) == (True, True)
    assert sel.narrows_at(1) and not sel.narrows_at(0)
    keep = sel.after_layer(check_probe(sel))
    # weight: half uniform (0.005 each), half attention (0.1 each for 0-4)
    w = np.full(100, 0.005)
    w[:5] += 0.1
    root = np.full(100, 0.05)
    root[:10] = 0.5
    assert sel.measured == pytest.approx((w * root)[:99].sum())  # 99 is always recomputed
    # bound 0.08 at the gate -> 0.01 at the check: 0-9 (the heaviest scores) and no more
    # (the 89 others left: 89 * 0.005 * 0.05 = 0.0223 > 0.01 -> more, by stable order)
    assert set(range(10)) <= set(sel._kept) and 99 in sel._kept
    assert sel.residual <= 0.01 + 1e-12
    assert sel.residual == pytest.approx((w * root)[np.setdiff1d(np.arange(100), sel._kept)].sum())
    # sentinels: 10 of the rest (10%), drawn with a fixed seed, and carried on
    assert len(sel._sentinels) == 10 and not set(sel._sentinels) & set(sel._kept)
    assert np.array_equal(keep, np.union1d(sel._kept, sel._sentinels))
    again = adaptive()
    again.after_layer(check_probe(again))
    assert np.array_equal(again._sentinels, sel._sentinels)  # every TP rank draws the same
    assert sel.wants_probe(2) == (False, False) and sel.wants_probe(3) == (True, True)
    return sel, keep


def test_adaptive_sentinels_are_a_share_of_the_candidates_at_most_max_sentinels():
    """The gate's estimate is as precise as its sample is large, not as its share: long prompts
    carry no more sentinels than ``max_sentinels`` (and short ones at least 8)."""
    wide = adaptive(sentinels=0.3)
    wide.after_layer(check_probe(wide))
    assert len(wide._sentinels) == 30  # 30% of the 100 candidates
    capped = adaptive(sentinels=0.3, max_sentinels=12)
    capped.after_layer(check_probe(capped))
    assert len(capped._sentinels) == 12 and not set(capped._sentinels) & set(capped._kept)
    floor = adaptive(sentinels=0.01, max_sentinels=12)
    floor.after_layer(check_probe(floor))
    assert len(floor._sentinels) == 8


def gate_probe(sel, keep, sentinel_root):
    root = np.zeros(len(keep))
    root[np.isin(keep, sel._sentinels)] = sentinel_root
    return probe(3, keep, root**2, np.ones(100))  # uniform attention there


def test_adaptive_gate_passes_and_drops_its_sentinels_where_the_error_left_is_small():
    sel, keep = checked()
    left = 100 - len(sel._kept)
    out = sel.after_layer(gate_probe(sel, keep, 0.1))
    assert sel.gate_residual == pytest.approx(left / 100 * 0.1)  # weight left x mean deviation
    assert sel.gate_residual <= 0.08 and sel.escalations == 0
    assert np.array_equal(keep[out], sel._kept)
    assert sel.wants_probe(3) == (False, False)  # one gate


def test_adaptive_gate_escalates_to_more_then_to_every_candidate():
    sel, keep = checked()
    first = len(sel._kept)
    out = sel.after_layer(gate_probe(sel, keep, 0.4))  # 0.4 x ~0.8 of the weight: too much
    assert isinstance(out, Escalate) and sel.escalations == 1
    # enough kept that the weight left x 0.4 is under 0.08: at most 20 of 100 left
    assert len(sel._kept) >= 80 and len(sel._kept) > first
    assert np.array_equal(out.keep, np.union1d(sel._kept, sel._sentinels))
    # new sentinels: none recomputed past the check by the first pass
    assert not set(sel._sentinels) & set(keep)
    # the runner goes back to the check layer: no new choice there
    assert sel.wants_probe(1) == (False, False) and not sel.narrows_at(1)
    assert sel.after_layer(probe(1, np.arange(100)[out.keep])) is None
    assert sel.wants_probe(3) == (True, True)
    out = sel.after_layer(gate_probe(sel, np.arange(100)[out.keep], 0.9))
    assert isinstance(out, Escalate) and sel.escalations == 2
    assert np.array_equal(out.keep, np.arange(100)) and sel.residual == 0
    assert sel.wants_probe(3) == (False, False)


def test_adaptive_declines_an_escalation_past_its_decline_share():
    sel, keep = checked()
    sel.decline_share = 0.5
    out = sel.after_layer(gate_probe(sel, keep, 0.4))  # would keep >= 80 of 100
    assert isinstance(out, Decline) and sel.declined and sel.escalations == 1
    assert sel.wants_probe(3) == (False, False)


def test_adaptive_sizes_an_escalation_for_its_samples_spread():
    """Sized for the sentinels' mean deviation alone, an escalation left the second gate's
    estimate about on the bound: traced on 2K and 4K rag-reorder, both second gates failed,
    and each load was declined after a whole second pass (the bench's declines spent 15-35% of
    cold's TTFT recomputing before the decision). Sized for the mean plus a standard error, a
    sample whose mean is carried by a few heavy positions escalates further, or where that
    passes the decline share, is declined at the first gate."""

    def first_gate(roots, decline_share=1.0):
        sel, keep = checked()
        sel.decline_share = decline_share
        dev = np.zeros(len(keep))
        dev[np.isin(keep, sel._sentinels)] = roots
        return sel, sel.after_layer(probe(3, keep, dev**2, np.ones(100)))

    flat = first_gate(np.full(10, 0.4))
    heavy = first_gate(np.tile([0.0, 0.8], 5))  # the same mean, 0.4
    assert flat[0].gate_residual == pytest.approx(heavy[0].gate_residual)
    assert isinstance(flat[1], Escalate) and isinstance(heavy[1], Escalate)
    assert len(heavy[0]._kept) > len(flat[0]._kept) >= 80  # a flat sample: sized as before
    share = (len(flat[0]._kept) + 0.5) / 100  # the flat escalation fits it, the heavy one not
    assert isinstance(first_gate(np.full(10, 0.4), share)[1], Escalate)
    sel, out = first_gate(np.tile([0.0, 0.8], 5), share)
    assert isinstance(out, Decline) and sel.declined and sel.escalations == 1


def test_adaptive_declines_at_the_check_layer_when_its_first_choice_is_past_the_decline_share():
    # bound 0 at the check: every candidate would be kept -> declined there, before any pass on
    sel = adaptive(bound=0.0, decline_share=0.5)
    out = sel.after_layer(check_probe(sel))
    assert isinstance(out, Decline) and sel.declined and sel.escalations == 0
    assert sel.measured is not None and sel.gate_residual is None
    assert sel.wants_probe(3) == (False, False)  # no sentinels: no gate
    # the same choice under a share it fits is run
    fits = adaptive(bound=0.0, decline_share=1.0)
    assert not isinstance(fits.after_layer(check_probe(fits)), Decline) and not fits.declined


def test_adaptive_share_floor_and_ceiling_and_no_gate():
    loose = adaptive(bound=10.0, min_share=0.3, gate_layer=0)
    loose.after_layer(check_probe(loose))
    assert len(loose._kept) == 30 + 1 and len(loose._sentinels) == 0  # floor, plus always
    assert loose.wants_probe(3) == (False, False)
    tight = adaptive(bound=0.0, max_share=0.2)
    tight.after_layer(check_probe(tight))
    assert len(tight._kept) == 20 + 1  # ceiling, plus always


def test_always_recompute_covers_unaligned_other_tokens_stretch_heads_and_the_tail():
    # stretches of consecutive donor positions start at 1 (5..10), 7 (2..4) and 10 (11, 12)
    donor_pos = np.array([-1, 5, 6, 7, 8, 9, 10, 2, 3, 4, 11, 12])
    same = np.ones(12, dtype=bool)
    same[10] = False
    got = always_recompute(np.arange(12), donor_pos, same, run_head=2, tail=1)
    assert np.array_equal(got, [0, 1, 2, 7, 8, 10, 11])
    # the loaded range may start inside a stretch: its first position is no head then
    assert np.array_equal(always_recompute(np.arange(3, 6), donor_pos, same, 2, 0), [])


def test_make_selection_follows_the_config():
    cfg = SemShareConfig.from_extra_config(
        {
            "recompute_ratio": 0.5,
            "recompute_check_layer": 0,
            "recompute_min_tokens": 3,
            "semsharekv_window": 8,
            "recompute_max_sentinels": 16,
        },
        environ={},
    )
    loaded = np.arange(4, 20)
    assert isinstance(make_selection("all", loaded, np.array([]), cfg), Fixed)
    cb = make_selection("cacheblend", loaded, np.array([5]), cfg)
    assert isinstance(cb, CacheBlend) and cb.ratio == 0.5 and cb.check_layer == 0
    assert cb.min_tokens == 3
    assert np.array_equal(cb.always, [5])
    assert make_selection("semsharekv", loaded, np.array([]), cfg).window == 8
    ad = make_selection("adaptive", loaded, np.array([5]), cfg)
    assert isinstance(ad, Adaptive) and ad.bound == cfg.recompute_error_bound
    assert ad.gate_layer == cfg.recompute_gate_layer and ad.min_tokens == 3
    assert ad.max_sentinels == 16
    assert SemShareConfig().recompute_policy == "adaptive"
    with pytest.raises(ValueError):
        make_selection("none", loaded, np.array([]), cfg)


@pytest.mark.parametrize("policy", ["adaptive", "cacheblend", "semsharekv"])
def test_the_donors_measured_deviation_leaves_out_what_is_always_recomputed(policy):
    """What a load reports as its donor's deviation (``measured``: the provenance's
    ``deviation_before``, the divergence eviction policy's input) is about the KV the donor
    could serve. Positions always recomputed are never served from it, and an unaligned one
    holds whatever its page held before the load (stale KV, zeros): counted in, that garbage
    made the figure (0.06 on a 2K reordered-passage load) depend on the pages vLLM handed out."""
    loaded = np.arange(100)
    always = np.arange(90, 100)  # unaligned: their "donor KV" is whatever the page held
    root = np.full(100, 0.05)
    attention = np.full(100, 0.01)

    def measured(garbage: float) -> tuple[float, float]:
        dev = root.copy()
        dev[always] = garbage
        if policy == "adaptive":
            sel = adaptive(always=always)
            sel.after_layer(probe(1, loaded, dev**2, attention))
        elif policy == "cacheblend":
            sel = CacheBlend(loaded, always=always, ratio=0.2, check_layer=1)
            sel.after_layer(probe(1, loaded, dev**2))
        else:
            sel = SemShareKV(loaded, always=always)
            sel.after_layer(probe(0, loaded, dev**2, attention))
        return sel.measured, sel.residual

    clean, dirty = measured(0.05), measured(1.0)
    assert dirty == pytest.approx(clean)
    if policy == "adaptive":  # the weighted error left with only ``always`` recomputed
        assert clean[0] == pytest.approx(90 * 0.01 * 0.05)  # (every weight 0.01 here)
    else:  # a mean over the 90 servable positions
        assert clean[0] == pytest.approx(0.05)


def test_a_load_whose_every_position_is_always_recomputed_reports_no_deviation():
    """Nothing of the donor's KV could be served: no deviation before, none after (not 0.0
    after a null before)."""
    loaded = np.arange(20)
    sel = Adaptive(loaded, always=loaded, bound=0.08, check_layer=1, gate_layer=3)
    sel.after_layer(probe(1, loaded, np.full(20, 0.01), np.full(20, 0.05)))
    assert sel.measured is None and sel.residual is None
    blend = CacheBlend(loaded, always=loaded, ratio=0.2, check_layer=1)
    blend.after_layer(probe(1, loaded, np.full(20, 0.01)))
    assert blend.measured is None and blend.residual is None
