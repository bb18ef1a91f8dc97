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
* ``Adaptive`` (the default): every loaded position up to and including the check layer;
  there, positions are taken in order of their deviation weighted by the attention the prompt's
  last tokens pay them, until the weighted deviation left (``residual``) is under a bound. At a
  later gate layer it measures again, on sentinel positions carried there; where the deviation
  left is still above the bound it escalates in the same recompute (``Escalate``): more
  positions, then every one; or, where that would be most of them, it declines the load
  (``Decline``) and vLLM computes the prompt. The bound, not a ratio, is the knob.
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


@dataclass
class Escalate:
    """``after_layer``'s answer where the repair so far is not enough: the runner goes back to
    the layer where the selection narrowed (``narrows_at``), takes the hidden states every
    candidate had when it entered that layer, and runs ``keep`` (indices into ``start()``)
    through it and the layers after."""

    keep: np.ndarray


class Decline:
    """``after_layer``'s answer where the repair would cost more than computing the prompt:
    the runner stops, and the load is reported failed (vLLM computes those tokens)."""


class Selection:
    """Base: start with ``start``; keep everyone unless a subclass says otherwise."""

    escalations = 0  # how many times the selection asked for more in the same recompute
    declined = False  # it answered ``Decline``
    gate_residual: float | None = None  # the error left a gate measured last (None: no gate)

    window = 0  # last tokens whose attention the probe sums (0: no attention probe)
    # Mean relative L2 deviation (0 = the donor KV was right) of the positions probed at the
    # policy's first measuring layer, ``always`` left out (an unaligned position holds
    # whatever its page held, and none of them is ever served from the donor): what the load
    # reports as this donor's quality (None: no position it could serve). ``Adaptive``: the
    # weighted error the load would carry with only ``always`` recomputed, its ``residual``'s
    # measure before the choice.
    measured: float | None = None
    # The same once the positions kept there are recomputed (their own KV: deviation 0): what
    # the repair left at that layer, for the request's provenance (None with ``measured``).
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

    def after_layer(self, probe: LayerProbe) -> np.ndarray | Escalate | Decline | None:
        """Indices into ``probe.positions`` that go on (sorted), None for all, ``Escalate``
        to run the narrowing layer and those after it again with more positions, or
        ``Decline``."""
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
            servable = ~np.isin(probe.positions, self.always)
            if not servable.any():
                return
            deviation = np.sqrt(np.clip(probe.deviation, 0, None))
            self.measured = float(deviation[servable].mean())
            left = servable.copy()
            left[keep] = False
            self.residual = float(np.where(left, deviation, 0.0)[servable].mean())

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


class Adaptive(Selection):
    """Recompute until the estimated error left is under ``bound`` (module docstring).

    Error is each position's relative K/V deviation (square root of the probe's) weighted by
    ``w = (1/n + a/sum(a)) / 2``: ``a`` the attention the last ``window`` tokens pay the
    position in that layer, ``n`` the number of candidates. Attention in one layer is a noisy
    proxy for the others, so half the weight is uniform: a large deviation is never left only
    because that layer looked elsewhere. The error left is the sum of ``w * deviation`` over
    the positions not recomputed: a weighted mean over the candidates, 0 when all are
    recomputed. ``bound`` applies at the gate layer, where what the donor KV misses has had
    more layers to show (on real pairs the error left measured there was 4-10x the check
    layer's).

    * Check layer: every candidate's deviation is measured; positions are taken in order of
      ``w * deviation`` until the error left there is under ``bound / CHECK_TO_GATE`` (at
      least ``min_share`` / ``min_tokens``, at most ``max_share``; ``always`` on top).
      ``measured`` and ``residual`` are the check layer's error before and after.
    * Sentinels: ``sentinels`` of the candidates left (at least 8, at most ``max_sentinels``:
      the estimate is as precise as the sample is large, whatever the prompt's length), drawn
      at random with a fixed seed (every tensor-parallel rank draws the same), go on to the
      gate layer.
    * Gate layer: the sentinels' deviation there, weighted by that layer's ``w``, estimates the
      error of every position left (``gate_residual``: the weight left times the sentinels'
      weighted mean deviation). Above ``bound`` the selection escalates (``Escalate``): first
      to as many positions (in the check layer's order) as leave little enough weight for
      that mean deviation, plus ``ESCALATION_Z`` of its standard errors, to stay under
      ``bound``, with new sentinels; if the gate fails again, to every candidate. Without a
      gate layer, the check layer's choice stands.
    * Decline: a choice that would recompute more than ``decline_share`` of the candidates is
      not run, whether the check layer's first or an escalation's; the load is declined
      (``Decline``) and vLLM computes the prompt, which is cheaper than the runner redoing most
      tokens. Declined at the check layer, only layers 0 and 1 were spent.
    """

    CHECK_TO_GATE = 8.0  # what the error left grew from layer 1 to 8 (median, real pairs)
    # An escalation is sized for the sentinels' mean deviation plus this many of its standard
    # errors: sized for the mean itself, the second gate's estimate lands about on the bound,
    # and a second failure is a decline after a whole second pass
    ESCALATION_Z = 1.0

    def __init__(
        self,
        candidates,
        always=None,
        bound: float = 0.02,
        min_share: float = 0.0,
        max_share: float = 1.0,
        check_layer: int = 1,
        gate_layer: int = 0,
        sentinels: float = 0.03,
        window: int = 32,
        min_tokens: int = 0,
        decline_share: float = 1.0,
        max_sentinels: int = 64,
    ):
        super().__init__(candidates, always)
        self.bound, self.min_share, self.max_share = bound, min_share, max_share
        self.decline_share = decline_share
        self.check_layer, self.window, self.min_tokens = check_layer, window, min_tokens
        # no gate where it would not come after the check layer
        self.gate_layer = gate_layer if gate_layer > check_layer else None
        self.sentinel_share, self.max_sentinels = sentinels, max_sentinels
        self._rng = np.random.default_rng(len(self.candidates))
        self._passes = 0  # how many times the runner went through the check layer
        # per candidate index: its check-layer score (weighted deviation); the order to
        # recompute in
        self._score = self._order = None
        self._forced = np.zeros(0, dtype=np.int64)  # candidate indices of ``always``
        self._kept = np.zeros(0, dtype=np.int64)  # candidate indices recomputed to the end
        self._sentinels = np.zeros(0, dtype=np.int64)  # candidate indices carried to the gate
        self._touched = np.zeros(0, dtype=np.int64)  # recomputed past the check by some pass

    def wants_probe(self, layer):
        if layer == self.check_layer and self._passes == 0:
            return True, True
        if layer == self.gate_layer and len(self._sentinels):
            return True, True
        return False, False

    def narrows_at(self, layer):
        return layer == self.check_layer and self._passes == 0

    def after_layer(self, probe):
        if probe.layer == self.check_layer:
            self._passes += 1
            if self._passes == 1:
                return self._check(probe)
            return None  # an escalated pass: its positions came with ``Escalate``
        if probe.layer == self.gate_layer and probe.deviation is not None:
            return self._gate(probe)
        return None

    def _weights(self, attention: np.ndarray | None) -> np.ndarray:
        n = len(self.candidates)
        uniform = np.full(n, 1.0 / n)
        if attention is None:
            return uniform
        a = np.clip(attention[self.candidates], 0, None)
        total = a.sum()
        return uniform if total <= 0 else 0.5 * uniform + 0.5 * a / total

    # ---- the check layer ---------------------------------------------------------------------
    def _check(self, probe: LayerProbe) -> np.ndarray | Decline:
        # probe.positions are the candidates (every one runs through the check layer)
        deviation = np.sqrt(np.clip(probe.deviation, 0, None))
        score = self._score = self._weights(probe.attention) * deviation
        forced = np.isin(self.candidates, self.always)
        order = np.argsort(-np.where(forced, -1.0, score), kind="stable")
        self._order = order[~forced[order]]
        self._forced = np.flatnonzero(forced)
        self.measured = float(score[~forced].sum()) if not forced.all() else None
        count = _first_at_most(_left_after(score[self._order]), self.bound / self.CHECK_TO_GATE)
        n = len(self.candidates)
        count = max(count, int(np.ceil(self.min_share * n)), self.min_tokens)
        count = min(count, int(np.floor(self.max_share * n)), len(self._order))
        if self._too_many(count):  # the first choice already costs more than cold: stop here
            return self._decline()
        return self._keep(count)

    def _keep(self, count: int) -> np.ndarray:
        """Keep ``always`` and the first ``count`` of ``_order``; draw the sentinels from the
        rest. Candidate indices that go on past this layer."""
        self._kept = np.union1d(self._forced, self._order[:count])
        left = np.ones(len(self.candidates), dtype=bool)
        left[self._kept] = False
        self.residual = None if self.measured is None else float(self._score[left].sum())
        self._sentinels = np.zeros(0, dtype=np.int64)
        if self.gate_layer is not None:
            # never one an earlier pass recomputed past the check: its KV there is fresh
            pool = np.setdiff1d(self._order[count:], self._touched)
            share = int(round(self.sentinel_share * len(self.candidates)))
            size = min(len(pool), max(min(share, self.max_sentinels), 8))
            self._sentinels = np.sort(self._rng.choice(pool, size, replace=False))
        self._touched = np.union1d(self._touched, np.union1d(self._kept, self._sentinels))
        return np.union1d(self._kept, self._sentinels)

    # ---- the gate layer ----------------------------------------------------------------------
    def _gate(self, probe: LayerProbe) -> np.ndarray | Escalate | Decline:
        idx = np.searchsorted(self.candidates, probe.positions)  # candidate index of each
        dev = np.sqrt(np.clip(probe.deviation, 0, None))
        weight = self._weights(probe.attention)
        sent = np.isin(idx, self._sentinels)
        w_sent = weight[idx[sent]]
        mean_dev, upper = _weighted_mean_upper(dev[sent], w_sent, self.ESCALATION_Z)
        left = np.ones(len(self.candidates), dtype=bool)
        left[self._kept] = False
        self.gate_residual = float(weight[left].sum() * mean_dev)
        if self.gate_residual <= self.bound:
            self._sentinels = np.zeros(0, dtype=np.int64)
            return np.flatnonzero(np.isin(idx, self._kept))  # the sentinels stop here
        self.escalations += 1
        if self.escalations == 1 and mean_dev > 0:
            # keep, in the check layer's order, until the weight left times that mean
            # deviation's upper bound is under the bound
            count = _first_at_most(_left_after(weight[self._order]), self.bound / upper)
            if count > len(self._kept) - len(self._forced):
                if self._too_many(count):
                    return self._decline()
                return Escalate(self._keep(count))
        if self._too_many(len(self._order)):
            return self._decline()
        self._keep(len(self._order))  # every candidate: nothing is left, no gate again
        return Escalate(np.arange(len(self.candidates)))

    def _too_many(self, count: int) -> bool:
        return (count + len(self._forced)) > self.decline_share * len(self.candidates)

    def _decline(self) -> Decline:
        self.declined = True
        self._sentinels = np.zeros(0, dtype=np.int64)
        return Decline()


def _weighted_mean_upper(values: np.ndarray, weights: np.ndarray, z: float) -> tuple[float, float]:
    """The ``weights``-weighted mean of ``values`` (a sample), and that mean plus ``z`` of its
    standard errors (the sample's weighted spread; a heavy position drawn widens it)."""
    total = float(weights.sum())
    if total <= 0 or not len(values):
        return 0.0, 0.0
    mean = float((weights * values).sum() / total)  # (as the gate always took it: bit for bit)
    p, n = weights / total, len(values)
    # (one value: no spread to measure, the mean itself)
    var = float((p**2 * (values - mean) ** 2).sum()) * n / (n - 1) if n > 1 else 0.0
    return mean, mean + z * var**0.5


def _left_after(values: np.ndarray) -> np.ndarray:
    """``[k]``: the sum of ``values`` past the first ``k`` (k = 0 .. len)."""
    return values.sum() - np.cumsum(np.concatenate([[0.0], values]))


def _first_at_most(left: np.ndarray, bound: float) -> int:
    """The first index where the non-increasing ``left`` is at most ``bound`` (its last index
    where none is)."""
    ok = left <= bound
    return int(np.argmax(ok)) if bool(ok.any()) else len(left) - 1


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
    run_head: int = 4,
    tail: int = 8,
    echoes: np.ndarray | None = None,
    echo_span: int = 0,
    echo_max_share: float = 1.0,
) -> np.ndarray:
    """Positions of ``loaded`` whose donor KV cannot be right: no donor token, a different
    donor token (measured as no better than a random token's KV), the first ``run_head`` tokens
    of every stretch aligned to consecutive donor positions (they attended to other tokens in
    the donor), the last ``tail`` loaded positions, and where ``echo_span`` > 0, the echoes'
    spans (``echo_spans``: the deeper layers read those passages in the other prompt's
    context). A stretch is read from ``donor_pos`` itself, not from the exact stage's runs:
    the edit, sentence and LSH stages align same tokens outside any run, down to a lone
    newline of another instruction."""
    loaded = np.asarray(loaded, dtype=np.int64)
    out = [loaded[-tail:]] if tail > 0 and len(loaded) else []
    if echoes is not None and echo_span > 0:
        out.append(echo_spans(loaded, np.asarray(echoes), echo_span, echo_max_share))
    if donor_pos is not None:
        donor_pos = np.asarray(donor_pos, dtype=np.int64)
        bad = donor_pos[loaded] < 0
        if same_token is not None:
            bad |= ~same_token[loaded]
        out.append(loaded[bad])
        if run_head > 0:
            follows = np.zeros(len(donor_pos), dtype=bool)  # continues the stretch before it
            follows[1:] = (donor_pos[1:] == donor_pos[:-1] + 1) & (donor_pos[:-1] >= 0)
            starts = np.flatnonzero((donor_pos >= 0) & ~follows)
            heads = (starts[:, None] + np.arange(run_head)).ravel()
            out.append(np.intersect1d(heads, loaded))
    return np.unique(np.concatenate(out)) if out else np.zeros(0, dtype=np.int64)


def echo_spans(
    loaded: np.ndarray, echoes: np.ndarray, span: int, max_share: float = 1.0
) -> np.ndarray:
    """The positions of ``loaded`` inside an echo's span: the echo (``alignment.echoes``: the
    start of a pair of tokens that came earlier in the text the prompts do not share), its
    pair and the ``span`` tokens after it, with the span shortened, the same for every echo,
    until they hold at most ``max_share`` of the load; where even the pairs would not, the
    first of the pairs' positions that fit. Why a cap: on a short prompt with several echoes
    the spans made a quarter of a 512-token load always recomputed and its hit became a
    decline (docs/benchmarks.md, echoes); every echo keeps its first tokens before any one
    keeps its far end."""
    loaded = np.asarray(loaded, dtype=np.int64)
    echoes = np.asarray(echoes, dtype=np.int64)
    if not len(echoes) or not len(loaded):
        return np.zeros(0, dtype=np.int64)
    n, budget = int(loaded.max()) + 1, int(max_share * len(loaded))
    in_load = np.zeros(n, dtype=bool)
    in_load[loaded[loaded >= 0]] = True

    def inside(s: int) -> np.ndarray:  # the span's longer, the mask's larger: a binary search
        return _covered(echoes, 2 + s, n) & in_load

    lo = span  # the longest span that fits
    if int(inside(span).sum()) > budget:
        lo, hi = -1, span  # it lies in [lo, hi); -1: not even the pairs
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if int(inside(mid).sum()) <= budget else (lo, mid)
    if lo < 0:
        return np.flatnonzero(inside(0))[:budget]
    return np.flatnonzero(inside(lo))


def _covered(starts: np.ndarray, length: int, n: int) -> np.ndarray:
    """Mask of the positions below ``n`` inside ``[s, s + length)`` for any ``s`` of
    ``starts`` (a difference array: memory by ``n``, not by starts times length)."""
    starts = starts[(starts >= 0) & (starts < n)].astype(np.int64)
    edges = np.zeros(n + 1, dtype=np.int64)
    np.add.at(edges, starts, 1)
    np.add.at(edges, np.minimum(starts + length, n), -1)
    return np.cumsum(edges[:n]) > 0


def make_selection(
    policy: str, loaded: np.ndarray, always: np.ndarray, config, num_layers: int | None = None
) -> Selection:
    """The selection ``policy`` names, over the ``loaded`` positions, with a ``SemShareConfig``'s
    constants, for a model of ``num_layers`` layers (None: not known; a gate layer past the
    last is no gate)."""
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
    if policy == "adaptive":
        return Adaptive(
            loaded,
            always,
            config.recompute_error_bound,
            config.recompute_min_share,
            config.recompute_max_share,
            config.recompute_check_layer,
            config.recompute_gate_layer
            if num_layers is None or config.recompute_gate_layer < num_layers
            else 0,
            config.recompute_sentinels,
            config.recompute_attention_window,
            config.recompute_min_tokens,
            config.recompute_decline_share,
            config.recompute_max_sentinels,
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
