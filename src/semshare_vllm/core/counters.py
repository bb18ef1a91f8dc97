"""Every counter and histogram the connector keeps, with what it counts, and the recorder each
half counts into. No vLLM import: discovery and the catalog count here too (``stats.py`` hands
the counts to vLLM)."""

from __future__ import annotations

import threading
from collections import Counter

# Every counter, with what it counts. Scheduler-side first, then worker-side.
COUNTERS: dict[str, str] = {
    "lookups": "requests the scheduler looked up",
    "lookup_tokens": "prompt tokens looked up (beyond vLLM's own prefix cache)",
    "hits": "requests served (partly) from a donor",
    "hit_tokens": "prompt tokens claimed from donors",
    "donors_registered": "finished requests accepted as donors",
    "donors_evicted": "donors evicted (capacity) or dropped (found bad)",
    "donors_restored": "donors found again in persist_dir at start-up",
    "persisted_skipped": "persisted donor files skipped as corrupt or foreign",
    "persisted_incomplete": "partial donor files a killed writer left, removed at start-up",
    "connector_resets": "vLLM's reset_prefix_cache(reset_connector=True) (its pause and sleep, "
    "around weight updates), or a weight update the worker saw: every donor dropped, and "
    "nothing persisted or shared after",
    "fallbacks": "lookups or captures abandoned because of a connector fault",
    "semantic_lookups": "requests whose semantic donor search was started",
    "semantic_found": "searches that found a donor (cosine or SimHash) in the namespace",
    "semantic_misses": "searches that finished and found none",
    "lookups_without_shared_grams": "of those, answered at once: no donor shares enough token "
    "4-grams to be aligned (lookup_min_shared_grams)",
    "lookups_too_long_to_embed": "of those, answered at once: the prompt could not be embedded "
    "by lookup_deadline_ms at the embedder's measured speed, and no donor shares half of its "
    "token 4-grams",
    "lookup_timeouts": "searches not finished by lookup_deadline_ms (request went on without)",
    "lookups_skipped": "searches dropped unfinished because the exact prefix covered the prompt",
    "lookup_wait_ms": "milliseconds requests were held back (not scheduled) by their search",
    "donors_embedded": "donors made searchable (embedded off the scheduler thread)",
    "embed_ms": "milliseconds the discovery threads spent embedding (lookups and donors)",
    "discovery_faults": "discovery jobs that failed (the request went on without)",
    "donors_published": "donors announced on the shared index (their KV readable in LMCache's "
    "remote backend)",
    "donors_shared_in": "donors other instances announced, added to this instance's index",
    "shared_records_dropped": "shared-index records not used (unreadable, id not matching "
    "their tokens, backlog full)",
    "shared_records_forged": "shared-index records, or the readiness marks of their KV, not "
    "signed with shared_index_secret (dropped)",
    "shared_records_unready": "shared-index records dropped because their KV never became "
    "readable (the announcing instance's LMCache put failed)",
    "shared_index_outages": "times the shared index became unreachable (this instance went on "
    "with its own donors until it was back)",
    "shared_publish_failures": "donor announcements lost to a shared-index outage",
    "semantic_hits": "requests served from a semantic (aligned, not exact-prefix) donor",
    "exact_reused_tokens": "of the semantic hits' claimed tokens, those given the same token's KV",
    "fuzzy_reused_tokens": "of those, given another token's KV (always recomputed)",
    "align_ms": "milliseconds from starting a request's alignment to its result",
    "align_timeouts": "alignments not done by lookup_deadline_ms (request went on without)",
    "loaded_tokens": "tokens written into the paged KV cache from donors",
    "block_copied_tokens": "of those, copied from a donor's own blocks while it was captured",
    "load_failures": "loads that failed (request recomputed those tokens)",
    "loads_not_read_in_time": "of those, loads whose donor's disk (persist_dir) or LMCache "
    "remote did not answer in time (DISK_READ_TIMEOUT_S, TIER_FETCH_TIMEOUT_S); the donor is "
    "kept",
    "loads_behind_unwritten_prefix": "repaired loads not run: vLLM's own prefix hit under them "
    "held blocks the same step computes or loads (reported failed; vLLM computes the tokens)",
    "waits_behind_unconfirmed_loads": "times a request was held one step because vLLM's own "
    "prefix hit held blocks of a load whose step had not come back (it may yet fail)",
    "unconfirmed_loads_uncached": "loads the worker never said it ran within a few steps: "
    "their blocks left vLLM's prefix cache (should stay 0)",
    "tp_peer_failures": "loads failed on this tensor-parallel rank because they failed on "
    "another (every rank reports the same blocks)",
    "captured_tokens": "tokens copied out of the paged KV cache into the host store",
    "captured_donors": "donors captured",
    "persist_backlog_skipped": "captured donors not written to persist_dir: the writes queued "
    "already held PERSIST_BACKLOG_FRACTION of the host store (a disk slower than the captures)",
    "discovery_backlog_skipped": "donor embeddings or alignment preparations dropped, oldest "
    "first: the background thread's queue was full (BACKLOG_JOBS, BACKLOG_TOKENS; donors "
    "arriving faster than they are embedded; such a donor is found by its text only)",
    "tier_backlog_skipped": "captured donors not put in LMCache: the puts waiting already held "
    "PERSIST_BACKLOG_FRACTION of the host store (a remote slower than the captures)",
    "weight_updates": "steps that found the model's weights updated in place since the last "
    "(reload_weights, update_weights, reset_weights, the model's load_weights): every donor "
    "of before dropped",
    "load_ms": "milliseconds spent loading donor KV",
    "tier_puts": "donors put in the LMCache tier (kv_tier), readable by other instances",
    "tier_put_failures": "donors the LMCache tier did not take (e.g. its backend unreachable)",
    "tier_put_ms": "milliseconds of tier puts, to readable (off the engine thread)",
    "tier_fetches": "loads whose donor was fetched from the LMCache tier into the host store",
    "tier_fetched_tokens": "tokens of donor KV fetched from the LMCache tier",
    "tier_fetch_ms": "milliseconds spent fetching donor KV from the LMCache tier",
    "tier_digest_mismatches": "another instance's donor KV fetched from the LMCache tier that "
    "was not what its rank signed (the load failed: recomputed)",
    "capture_ms": "milliseconds spent capturing donor KV",
    "recomputed_tokens": "loaded tokens recomputed through the model (in their first layer)",
    "recomputed_token_layers": "token-layers recomputed (a token recomputed in 3 layers: 3)",
    "recompute_unavailable_tokens": "loaded tokens needing repair with no layer runner here "
    "(reported failed: vLLM computed them)",
    "recompute_failures": "recomputes that failed (vLLM computed those tokens instead)",
    "recompute_ms": "milliseconds spent recomputing loaded tokens",
    "recompute_gate_checks": "repairs whose error left was measured again at the gate layer "
    "(recompute_policy adaptive)",
    "recompute_escalated_loads": "of those, repairs the gate found above recompute_error_bound "
    "and widened in the same recompute (more tokens, up to every one)",
    "recompute_escalations": "widenings of those repairs (at most 2 per repair: more tokens, "
    "then every one)",
    "recompute_declined": "repairs the gate would have widened past recompute_decline_share: "
    "declined, their tokens computed by vLLM (reported as failed loads)",
    "prompts_withheld_a_donor": "prompts a donor is no longer offered to: their load from it "
    "escalated at the recompute gate or was declined (vLLM computes them when sent again)",
    "donors_demoted_by_escalation": "donors no longer offered because loads from them into "
    "two prompts escalated or were declined",
    "deviation_sum": "sum of measured deviations of repaired semantic loads (their "
    "deviation_before: relative K/V deviation of the loaded tokens the donor could serve, at "
    "the policy's measuring layer)",
    "deviation_count": "repaired semantic loads whose deviation was measured",
    "reuse_opt_outs": "requests whose kv_transfer_params turned reuse off or down to exact",
    "reuse_forced": "requests whose kv_transfer_params asked for a semantic donor regardless",
    "unkeyable_requests": "requests never served nor captured: their token ids do not say what "
    "their KV is (prompt embeddings)",
    "failed_blocks_uncached": "blocks of failed loads (and those computed after them) taken out "
    "of vLLM's prefix cache",
    "failed_loads_preempted": "requests preempted when their load failed while their next step "
    "was already running over it (async scheduling): that step's output dropped, the prompt "
    "computed again",
}


_MS_BUCKETS = (1.0, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 2500.0, 5000.0, 10000.0)

# Every histogram: what one observation is, and its buckets' upper bounds. One observation per
# finished request, from the figures its provenance reports (``scheduler/provenance``): the
# ``served_`` ones for a request served from a donor, the ``declined_`` ones for a load the gate
# declined, the ``missed_`` ones for a request no donor served (a failed load: none).
HISTOGRAMS: dict[str, tuple[str, tuple[float, ...]]] = {
    "served_recompute_share": (
        "per request served from a donor: the share of its served tokens' layer work that was "
        "recomputed (recomputed token-layers / (served tokens x layers); 0 for exact KV)",
        (0.0, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0),
    ),
    "served_deviation_before": (
        "per repaired semantic hit: relative K/V deviation of the donor KV from the "
        "request's own, at the policy's measuring layer, before the repair (the tokens the "
        "donor could serve; always-recomputed ones count as recomputed)",
        (0.01, 0.025, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0, 1.5),
    ),
    "served_deviation_after": (
        "per repaired semantic hit: the same deviation once the recomputed positions hold their "
        "own KV (what the repair left)",
        (0.01, 0.025, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0, 1.5),
    ),
    "served_gate_residual": (
        "per repaired semantic hit under the adaptive policy with a gate: the error the gate "
        "estimated the tokens not recomputed still carry (its last estimate; the bound is "
        "recompute_error_bound)",
        (0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.05, 0.1),
    ),
    # the hit's time breakdown (its provenance's ``timings_ms``)
    "served_search_ms": (
        "per request served from a donor: milliseconds it was held back (not scheduled) "
        "waiting for its donor search",
        _MS_BUCKETS,
    ),
    "served_align_ms": (
        "per request served from a donor: milliseconds it was held back waiting for its alignment",
        _MS_BUCKETS,
    ),
    "served_load_ms": (
        "per repaired semantic hit: milliseconds the worker spent moving the donor KV into "
        "its blocks (RoPE-corrected); where the move runs beside the recompute's layer 0 "
        "(CPU), what the recompute waited for it",
        _MS_BUCKETS,
    ),
    "served_recompute_ms": (
        "per repaired semantic hit: milliseconds of its selective recompute",
        _MS_BUCKETS,
    ),
    "served_recompute_whole_ms": (
        "per repaired semantic hit: the part of its recompute spent in the layers that ran "
        "every position (layer 0, the check layer's probe)",
        _MS_BUCKETS,
    ),
    # what a miss cost: its request held back for a donor that did not serve it
    "missed_search_ms": (
        "per request not served from a donor (opted out, nothing found, withheld, timed out): "
        "milliseconds it was held back waiting for its donor search",
        _MS_BUCKETS,
    ),
    "missed_align_ms": (
        "per request not served from a donor: milliseconds it was held back waiting for an "
        "alignment that did not serve it",
        _MS_BUCKETS,
    ),
    # what a declined load cost before vLLM computed the prompt (its provenance's
    # ``timings_ms``, the recompute up to the decline)
    "declined_search_ms": (
        "per load the recompute gate declined: milliseconds its request was held back waiting "
        "for its donor search",
        _MS_BUCKETS,
    ),
    "declined_align_ms": (
        "per load the recompute gate declined: milliseconds its request was held back waiting "
        "for its alignment",
        _MS_BUCKETS,
    ),
    "declined_load_ms": (
        "per load the recompute gate declined: milliseconds the worker spent moving the donor "
        "KV (or, beside the recompute's layer 0, what the recompute waited for it)",
        _MS_BUCKETS,
    ),
    "declined_recompute_ms": (
        "per load the recompute gate declined: milliseconds of its recompute up to the decline "
        "(vLLM's computation of the prompt comes after)",
        _MS_BUCKETS,
    ),
}


# Histograms of one vector per request (element i: layer i of the model), exported with a
# ``layer`` label: where a hit's recompute spent its time, by layer.
LAYER_HISTOGRAMS: dict[str, tuple[str, tuple[float, ...]]] = {
    "served_recompute_layer_ms": (
        "per repaired semantic hit and layer of the model: milliseconds of its selective "
        "recompute in that layer (label layer; an escalated layer holds both of its runs)",
        _MS_BUCKETS,
    ),
}


class StatsRecorder:
    """One half's counters and histogram observations: the current interval's (taken for vLLM's
    stats channel) and running totals (read in-process by tests and benchmarks). Thread-safe:
    the components it is handed to add from their own threads while the engine thread takes."""

    def __init__(self) -> None:
        self.totals: Counter[str] = Counter()
        # the latest observations (at least KEEP_OBSERVED), per histogram (of a per-layer
        # one: a list per observation)
        self.observed: dict[str, list] = {}
        self._interval: Counter[str] = Counter()
        self._observations: dict[str, list] = {}
        self._lock = threading.Lock()

    def add(self, name: str, value: float = 1) -> None:
        if name not in COUNTERS:
            raise KeyError(name)
        with self._lock:
            self.totals[name] += value
            self._interval[name] += value

    KEEP_OBSERVED = 4096  # of each histogram's running record, the latest kept

    def observe(self, name: str, value: float) -> None:
        if name not in HISTOGRAMS:
            raise KeyError(name)
        with self._lock:
            self._keep(name, float(value))
            self._observations.setdefault(name, []).append(float(value))

    def observe_layers(self, name: str, values: list[float]) -> None:
        """One observation of a per-layer histogram: ``values[i]`` is layer i's."""
        if name not in LAYER_HISTOGRAMS:
            raise KeyError(name)
        vector = [float(v) for v in values]
        with self._lock:
            self._keep(name, vector)
            self._observations.setdefault(name, []).append(list(vector))

    def _keep(self, name: str, value) -> None:
        """Into the running record: bounded, as a server records one per hit for its life."""
        kept = self.observed.setdefault(name, [])
        kept.append(value)
        if len(kept) > 2 * self.KEEP_OBSERVED:
            del kept[: -self.KEEP_OBSERVED]

    def take(self) -> dict[str, float | list[float]] | None:
        """The interval's counts, and each histogram's observations as a list (None when
        nothing happened); starts a new interval."""
        with self._lock:
            if not any(self._interval.values()) and not self._observations:
                return None
            out: dict[str, float | list[float]] = dict(self._interval)
            out.update(self._observations)
            self._interval, self._observations = Counter(), {}
        return out
