"""Recompute policies on hand-made probes."""

import numpy as np
import pytest

from semshare_vllm.config import SemShareConfig
from semshare_vllm.recompute.policy import (
    CacheBlend,
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
    # what the load reports: the mean deviation at layer 0 (sqrt: the probe's is squared),
    # and what is left once the kept positions hold their own KV
    root = np.sqrt(dev)
    assert sel.measured == pytest.approx(root.mean())
    assert sel.residual == pytest.approx(root[np.setdiff1d(loaded, keep)].sum() / 20)
    second = sel.after_layer(probe(1, keep, np.ones(len(keep))))
    assert len(second) == 1 + int(np.floor(5 * 0.5))  # always + decayed budget
    assert sel.measured == pytest.approx(root.mean())  # the first measuring layer's only


def test_always_recompute_covers_unaligned_other_tokens_run_heads_and_the_tail():
    donor_pos = np.array([-1, 5, 6, 7, 8, 9, 10, 2, 3, 4, 11, 12])
    same = np.ones(12, dtype=bool)
    same[10] = False
    got = always_recompute(
        np.arange(12), donor_pos, same, run_starts=np.array([1, 7]), run_head=2, tail=1
    )
    assert np.array_equal(got, [0, 1, 2, 7, 8, 10, 11])


def test_make_selection_follows_the_config():
    cfg = SemShareConfig.from_extra_config(
        {
            "recompute_ratio": 0.5,
            "recompute_check_layer": 0,
            "recompute_min_tokens": 3,
            "semsharekv_window": 8,
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
    with pytest.raises(ValueError):
        make_selection("none", loaded, np.array([]), cfg)
