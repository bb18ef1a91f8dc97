"""Which positions are recomputed, layer by layer: the recompute policies.

The layer runner asks a ``Selection`` which positions to start with, and after each layer shows
it what that layer measured (``LayerProbe``: each recomputed position's deviation between its
fresh K/V and the donor K/V it replaces, and on request how much attention the prompt's last
tokens pay to every position); the selection answers which positions go on to the next layer.
A position dropped after layer l keeps its fresh KV in layers <= l and the donor's above. Where a
layer narrows the set sharply (``narrows_at``), the runner computes every position's K/V there
first and the layer's attention and MLP only for the positions kept.

* ``Fixed``: the same positions in every layer (``recompute_policy="all"``: every loaded one).
* ``CacheBlend`` (Yao et al., EuroSys'25): every loaded position up to and including the check
  layer (default 1); there, the ``ratio`` with the highest deviation are kept for the remaining
  layers.
* ``SemShareKV`` (§4.3.3, appendix A.5): layer 0 in full; there, positions are split into hot
  and cold by attention recovery (the fewest positions holding ``hot_threshold`` of the last
  ``window`` tokens' attention), and ``hot_ratio`` of the hot and ``cold_ratio`` of the cold
  are kept by deviation; deeper layers keep a budget decaying by ``layer_decay`` per layer,
  re-ranked by each layer's deviation. The paper leaves the window, the decay constant and the
  deviation measure open: they are parameters here.

Every policy always keeps ``always`` (positions whose donor KV cannot be right: unaligned,
aligned to a different token, the first tokens of every run, the last tokens of the prompt).
Deviation is relative: ``|k' - k|^2 + |v' - v|^2`` over ``|k'|^2 + |v'|^2`` (scale-free across
tokens; the paper's L2 and CacheBlend's squared error rank the same within one token's scale).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class LayerProbe:
    layer: int
    positions: np.ndarray  # the positions recomputed in this layer (sorted)
    deviation: np.ndarray | None  # [len(positions)] relative K/V deviation from the donor
    attention: np.ndarray | None  # [context] attention mass the last tokens paid each position


class Selection:
    """Base: start with ``start``; keep everyone unless a subclass says otherwise."""

    window = 0  # last tokens whose attention the probe sums (0: no attention probe)
    # Mean relative L2 deviation (0 = the donor KV was right) of the positions probed at the
    # policy's first measuring layer: what the load reports as this donor's quality.
    measured: float | None = None
    # The same mean once the positions kept there are recomputed (their own KV: deviation 0):
    # what the repair left at that layer, for the request's provenance.
    residual: float | None = None

    def __init__(self, candidates: np.ndarray, always: np.ndarray | None = None):
        self.candidates = np.unique(np.asarray(candidates, dtype=np.int64))
        always = np.asarray(always if always is not None else [], dtype=np.int64)
        self.always = np.intersect1d(always, self.candidates)

    def start(self) -> np.ndarray:
        return self.candidates

    def wants_probe(self, layer: int) -> tuple[bool, bool]:
        """(deviation, attention) wanted after ``layer``."""
        return False, False

    def after_layer(self, probe: LayerProbe) -> np.ndarray | None:
        """Indices into ``probe.positions`` that go on (sorted), or None for all."""
        return None

    def narrows_at(self, layer: int) -> bool:
        """Whether ``layer``'s probe drops most positions: the runner then probes (K/V of every
        position) before running the layer's attention and MLP for the kept ones only (CacheBlend's
        "K/V of all, the rest for the selected" check layer)."""
        return False

    def _measure(self, probe: LayerProbe, keep: np.ndarray) -> None:
        """``measured`` and ``residual`` at the first layer that probed deviation; ``keep``:
        the indices into ``probe.positions`` recomputed from there on."""
        if self.measured is None and probe.deviation is not None and len(probe.deviation):
            deviation = np.sqrt(np.clip(probe.deviation, 0, None))
            self.measured = float(deviation.mean())
            left = np.ones(len(deviation), dtype=bool)
            left[keep] = False
            self.residual = float(np.where(left, deviation, 0.0).mean())

    def _keep_top(
        self, probe: LayerProbe, count: int, among: np.ndarray | None = None
    ) -> np.ndarray:
        """The ``always`` positions plus the ``count`` others (of ``among``, default all) with
        the highest deviation: sorted indices into ``probe.positions``."""
        pos = probe.positions
        forced = np.isin(pos, self.always)
        pool = ~forced if among is None else (~forced & among)
        idx = np.flatnonzero(pool)
        if count < len(idx):
            order = np.argsort(-probe.deviation[idx], kind="stable")
            idx = idx[order[: max(count, 0)]]
        return np.sort(np.concatenate([np.flatnonzero(forced), idx]))


class Fixed(Selection):
    """The same positions in every layer."""


class CacheBlend(Selection):
    def __init__(
        self,
        candidates,
        always=None,
        ratio: float = 0.15,
        check_layer: int = 1,
        min_tokens: int = 0,
    ):
        super().__init__(candidates, always)
        self.ratio, self.check_layer, self.min_tokens = ratio, check_layer, min_tokens

    def wants_probe(self, layer):
        return layer == self.check_layer, False

    def narrows_at(self, layer):
        return layer == self.check_layer

    def after_layer(self, probe):
        if probe.layer != self.check_layer:
            return None
        keep = self._keep_top(
            probe, max(int(round(self.ratio * len(self.candidates))), self.min_tokens)
        )
        self._measure(probe, keep)
        return keep


class SemShareKV(Selection):
    def __init__(
        self,
        candidates,
        always=None,
        hot_threshold: float = 0.55,
        hot_ratio: float = 0.5,
        cold_ratio: float = 0.1,
        layer_decay: float = 0.9,
        window: int = 32,
    ):
        super().__init__(candidates, always)
        self.hot_threshold, self.hot_ratio, self.cold_ratio = hot_threshold, hot_ratio, cold_ratio
        self.layer_decay, self.window = layer_decay, window
        self.budget = 0

    def wants_probe(self, layer):
        return True, layer == 0

    def narrows_at(self, layer):
        return layer == 0

    def after_layer(self, probe):
        if probe.layer == 0:
            hot = hot_positions(probe.attention, self.hot_threshold)
            is_hot = np.isin(probe.positions, hot)
            n_hot = int(round(self.hot_ratio * is_hot.sum()))
            n_cold = int(round(self.cold_ratio * (~is_hot).sum()))
            keep_hot = self._keep_top(probe, n_hot, among=is_hot)
            keep_cold = self._keep_top(probe, n_cold, among=~is_hot)
            keep = np.union1d(keep_hot, keep_cold)
            self._measure(probe, keep)
            self.budget = len(keep) - len(self.always)
            return keep
        self.budget = int(np.floor(self.budget * self.layer_decay))
        return self._keep_top(probe, self.budget)


def hot_positions(attention: np.ndarray, threshold: float) -> np.ndarray:
    """The fewest positions holding ``threshold`` of the attention mass (attention recovery)."""
    order = np.argsort(-attention, kind="stable")
    mass = np.cumsum(attention[order])
    total = mass[-1] if len(mass) else 0.0
    if total <= 0:
        return np.zeros(0, dtype=np.int64)
    count = int(np.searchsorted(mass, threshold * total)) + 1
    return np.sort(order[:count])


def always_recompute(
    loaded: np.ndarray,
    donor_pos: np.ndarray | None = None,
    same_token: np.ndarray | None = None,
    run_starts: np.ndarray | None = None,
    run_head: int = 4,
    tail: int = 8,
) -> np.ndarray:
    """Positions of ``loaded`` whose donor KV cannot be right: no donor token, a different
    donor token (measured as no better than a random token's KV), the first ``run_head`` tokens
    of every aligned run (they attended to other tokens in the donor), and the last ``tail``
    loaded positions."""
    loaded = np.asarray(loaded, dtype=np.int64)
    out = [loaded[-tail:]] if tail > 0 and len(loaded) else []
    if donor_pos is not None:
        bad = donor_pos[loaded] < 0
        if same_token is not None:
            bad |= ~same_token[loaded]
        out.append(loaded[bad])
    if run_starts is not None and run_head > 0:
        heads = (np.asarray(run_starts, dtype=np.int64)[:, None] + np.arange(run_head)).ravel()
        out.append(np.intersect1d(heads, loaded))
    return np.unique(np.concatenate(out)) if out else np.zeros(0, dtype=np.int64)


def make_selection(policy: str, loaded: np.ndarray, always: np.ndarray, config) -> Selection:
    """The selection ``policy`` names, over the ``loaded`` positions, with a ``SemShareConfig``'s
    constants."""
    if policy == "all":
        return Fixed(loaded)
    if policy == "cacheblend":
        return CacheBlend(
            loaded,
            always,
            config.recompute_ratio,
            config.recompute_check_layer,
            config.recompute_min_tokens,
        )
    if policy == "semsharekv":
        return SemShareKV(
            loaded,
            always,
            config.semsharekv_hot_threshold,
            config.semsharekv_hot_ratio,
            config.semsharekv_cold_ratio,
            config.semsharekv_layer_decay,
            config.semsharekv_window,
        )
    raise ValueError(f"no recompute selection for policy {policy!r}")
