"""The scheduler half (EngineCore process): decides what to claim, what to capture, what to evict.

Hit path today (exact prefix): find the donor of the request's namespace that shares the longest
block-aligned prefix beyond vLLM's own prefix cache, claim it (leaving at least one token to
compute), and tell the worker which donor tokens go into which blocks.

Semantic discovery (``discovery/``): when a request arrives (``on_new_request``) its donor search
starts on the discovery service's lookup thread; ``get_num_new_matched_tokens`` answers None
("ask again") while the search runs, up to ``lookup_deadline_ms``, then records the donors found
in ``found`` (the semantic hit path, alignment and recompute, builds on them). Finished requests
are embedded on the service's background thread and become searchable when this thread attaches
their vectors to the catalog.

Capture: when a request finishes, keep its blocks (``delay_free``) until the worker has copied
its KV into the host store and reported the request in ``finished_sending``.

Across instances (``shared_index_url``): each donor captured here is announced on the shared
index (``catalog/shared_index.py``) with its embedding, from the discovery thread once it is
embedded; the donors other instances announce (once their KV is readable) join this catalog, and
are loaded through the LMCache tier on first use.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass, replace
from pathlib import Path

from semshare_vllm.alignment import Alignment
from semshare_vllm.catalog.donor_index import DonorIndex, DonorRecord, PrefixMatch
from semshare_vllm.catalog.eviction import make_policy
from semshare_vllm.catalog.shared_index import SharedDonor, SharedDonorFeed
from semshare_vllm.config import SemShareConfig
from semshare_vllm.core.identity import keyable, namespace_of, semantic_allowed
from semshare_vllm.core.keys import DonorKey, block_hashes, donor_id_for
from semshare_vllm.discovery.service import DiscoveryService, Lookup
from semshare_vllm.discovery.snapshot import SnapshotEntry, load_snapshot, write_snapshot
from semshare_vllm.discovery.vector_index import Candidate
from semshare_vllm.layout.geometry import KVGeometry
from semshare_vllm.logs import warn_once
from semshare_vllm.metadata import (
    CaptureSpec,
    LoadSpec,
    SemShareConnectorMetadata,
    SemShareWorkerMetadata,
)
from semshare_vllm.planner import Aligner, SemanticPlan, coverage, plan_claim
from semshare_vllm.stats import StatsRecorder
from semshare_vllm.store import donor_file
from semshare_vllm.vllm_compat import block_hashes as vllm_block_hashes
from semshare_vllm.vllm_compat import prefix_cache_flags

logger = logging.getLogger("vllm.semshare.scheduler")

_WAIT = object()   # "ask again next step": the request's alignment is still running

# Per-request control, from the OpenAI request body's "kv_transfer_params": {"semshare": mode}.
REUSE_MODES = ("auto", "off", "exact", "semantic")
_bad_modes_logged: set[str] = set()


def reuse_mode(request) -> str:
    """"auto" (the config decides), "off" (no reuse, and the request is not kept as a donor),
    "exact" (exact-prefix reuse only), "semantic" (a semantic donor is used whatever its
    alignment coverage, as long as the worker can repair it)."""
    params = getattr(request, "kv_transfer_params", None)
    mode = params.get("semshare", "auto") if isinstance(params, dict) else "auto"
    if mode not in REUSE_MODES:
        if str(mode) not in _bad_modes_logged:
            _bad_modes_logged.add(str(mode))
            logger.warning("SemShare: kv_transfer_params semshare=%r is not one of %s; using "
                           "\"auto\"", mode, ", ".join(REUSE_MODES))
        return "auto"
    return mode

def reuse_limit(request) -> int | None:
    """``kv_transfer_params`` ``"semshare_reuse_limit": N``: reuse KV for at most the prompt's
    first N tokens; vLLM computes the rest. With it a request may also ask for prompt logprobs
    (vLLM's own prefix cache stays off for those): the positions from N on are scored by vLLM,
    the ones served are marked (``prompt_logprobs``)."""
    params = getattr(request, "kv_transfer_params", None)
    limit = params.get("semshare_reuse_limit") if isinstance(params, dict) else None
    if limit is None:
        return None
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        if "limit" not in _bad_modes_logged:
            _bad_modes_logged.add("limit")
            logger.warning("SemShare: kv_transfer_params semshare_reuse_limit=%r is not a "
                           "non-negative integer; ignored", limit)
        return None
    return limit


def wants_prompt_logprobs(request) -> bool:
    params = getattr(request, "sampling_params", None)
    return getattr(params, "prompt_logprobs", None) is not None


# Outputs after a request finished during which a failure of its load may still come back
# (async scheduling has up to two steps in flight).
FAILURE_REPORT_OUTPUTS = 3

# How often (at most) the donors' embeddings are written beside their KV files.
SNAPSHOT_INTERVAL_S = 30.0


@dataclass
class SemanticMatch:
    """Donors discovery found for a request (valid when found: present, same namespace, not
    demoted), best first, and the request's own embedding."""

    candidates: list[Candidate]
    lookup: Lookup


@dataclass
class _PendingLookup:
    future: Future
    started: float
    asked: float | None = None   # when vLLM first wanted to schedule the request
    held: float | None = None    # when we last told it to wait


class SemShareScheduler:
    def __init__(self, config: SemShareConfig, geometry: KVGeometry,
                 discovery: DiscoveryService | None = None, aligner: Aligner | None = None,
                 feed: SharedDonorFeed | None = None):
        self.config = config
        self.geometry = geometry
        self.stats = StatsRecorder()
        self.discovery = None if geometry.unsupported else discovery
        policy = make_policy(config.eviction_policy, half_life_s=config.decay_half_life_s,
                             threshold=config.divergence_threshold)
        # The worker's pool reports its real size in its first step (update_connector_output).
        self.index = DonorIndex(geometry.block_size, config.host_store_bytes, policy,
                                self.discovery.index if self.discovery else None)
        self.found: dict[str, SemanticMatch] = {}       # req_id -> donors discovery found
        self.feed = None if geometry.unsupported else feed
        self._lookups: dict[str, _PendingLookup] = {}
        self._snapshot_dirty = False
        self._snapshot_at = time.monotonic()
        self.aligner = aligner if self.discovery is not None else None
        if self.aligner is not None:
            # at normal priority: a niced thread starves while vLLM compiles and profiles at
            # start-up, and the first hit's alignment would then wait for the table to load
            self.discovery.run(self.aligner.warm)
        # req_id -> (alignment job on the discovery thread, when it started)
        self._aligning: dict[str, tuple[Future, float]] = {}
        self._aligned: dict[str, tuple[DonorKey, Alignment]] = {}  # req_id -> chosen donor
        self._approximate: set[str] = set()             # served from a semantic donor
        # req_id -> its blocks from the first one a load writes (a failed load's blocks, and
        # those computed after them, leave vLLM's prefix cache)
        self._loaded_blocks: dict[str, list[int]] = {}
        self._failed_loads: set[str] = set()            # never captured as donors
        # loads of requests that finished before their step's output came back: their failure
        # may still be reported (async scheduling) -> (blocks, outputs left to wait)
        self._finished_loads: dict[str, tuple[list[int], int]] = {}
        self._kv_cache_manager = None                   # vLLM's, for evicting failed blocks
        self.recompute_ready = False                    # the worker said it can repair
        # req_id -> match offered this step: an exact prefix, or a semantic plan
        self._matches: dict[str, PrefixMatch | SemanticPlan] = {}
        self._scoring: dict[str, object] = {}   # requests we let past skip_reading_prefix_cache
        self._loads: list[LoadSpec] = []
        self._captures: list[CaptureSpec] = []
        self._evictions: list[DonorKey] = []
        self._capturing: set[str] = set()               # req ids whose blocks we hold
        self._looked_up: set[str] = set()               # live req ids already counted
        self._faults_logged: set[str] = set()
        if geometry.unsupported:
            logger.warning("SemShare disabled for this model: %s; requests are computed as usual",
                           geometry.unsupported)
        elif self._persist_root is not None:
            self._restore(self._persist_root)

    @property
    def _persist_root(self) -> Path | None:
        if not self.config.persist_dir:
            return None
        return Path(self.config.persist_dir) / self.geometry.fingerprint

    # ---- discovery ----------------------------------------------------------------------------
    def on_new_request(self, request) -> None:
        try:
            # donors embedded or shared while the engine was idle join the index first
            self._absorb_embeddings()
            self._absorb_shared()
            self._start_lookup(request)
        except Exception:
            self._fault("discovery")

    def _start_lookup(self, request) -> None:
        d = self.discovery
        if d is None or d.failed or request.num_prompt_tokens < self.config.min_reuse_tokens \
                or self.geometry.unsupported:
            return
        if not keyable(request) or not semantic_allowed(request):
            return
        if reuse_mode(request) in ("off", "exact"):
            return
        namespace = namespace_of(request)
        if d.index.size(namespace) == 0:
            return  # nothing to find: never make a request wait for an empty namespace
        tokens = list(request.all_token_ids[:request.num_prompt_tokens])
        exact = self.index.longest_prefix(namespace, tokens)
        if exact is not None and exact.num_tokens >= self._claim_limit(request):
            return  # an exact donor already covers all we could claim: no search to pay for
        self._lookups[request.request_id] = _PendingLookup(d.lookup(namespace, tokens),
                                                           time.monotonic())
        self.stats.add("semantic_lookups")

    def _await_lookup(self, request, nothing_left: bool) -> bool:
        """True while the request should wait for its donor search (vLLM re-asks next step)."""
        pending = self._lookups.get(request.request_id)
        if pending is None:
            return False
        now = time.monotonic()
        if pending.asked is None:
            pending.asked = now
        # The deadline runs from arrival (the search started then).
        deadline = pending.started + self.config.lookup_deadline_ms / 1e3
        if not pending.future.done():
            if not nothing_left and now < deadline:
                pending.held = now
                return True
            pending.future.cancel()
            self.stats.add("lookup_timeouts" if not nothing_left else "lookups_skipped")
        else:
            self._take_lookup(request, pending.future)
        del self._lookups[request.request_id]
        # Held back: from vLLM's first wish to schedule it to the last time we said "wait"; its
        # time in vLLM's queue before or after is not ours.
        if pending.held is not None:
            self.stats.add("lookup_wait_ms", (pending.held - pending.asked) * 1e3)
        return False

    def _take_lookup(self, request, future: Future) -> None:
        if future.cancelled() or future.exception() is not None:
            return  # counted by the service as a discovery fault
        lookup: Lookup = future.result()
        self.stats.add("embed_ms", lookup.embed_ms)
        if lookup.no_shared_grams:
            self.stats.add("lookups_without_shared_grams")
        namespace = namespace_of(request)
        valid = []
        for c in lookup.candidates:  # re-check: the donor may have gone while we searched
            record = self.index.get(c.key)
            if record is not None and record.key.namespace == namespace and not record.demoted:
                valid.append(c)
        if valid:
            self.found[request.request_id] = SemanticMatch(valid, lookup)
            self.stats.add("semantic_found")
        else:
            self.stats.add("semantic_misses")

    def _absorb_embeddings(self) -> None:
        """Attach donors' embeddings computed on the discovery thread (the catalog is only ever
        changed on this thread)."""
        if self.discovery is None:
            return
        for e in self.discovery.take_embedded():
            if self.index.set_embedding(e.key, e.serial, e.embedding, e.fingerprint):
                self.stats.add("donors_embedded")
                self.stats.add("embed_ms", e.embed_ms)
                self._snapshot_dirty = True
        faults = self.discovery.take_faults()
        if faults:
            self.stats.add("discovery_faults", faults)

    # ---- the shared index ----------------------------------------------------------------------
    def _embed_and_announce(self, record: DonorRecord) -> None:
        """Embed a donor captured here and, with a shared index, publish it: once embedded, from
        the discovery thread (nothing waits for vLLM to step); at once without discovery.
        Readers wait for its KV themselves."""
        if self.feed is None:
            self._embed_later(record)
            return
        feed, key = self.feed, record.key
        shared = SharedDonor(key.namespace, key.donor_id, list(record.token_ids),
                             len(record.prompt_token_ids), self.geometry.tp_size)
        if self.discovery is None or self.discovery.failed:
            feed.publish(shared)
            return
        shared.embedder_id = self.discovery.embedder_id

        def with_embedding(embedded) -> None:
            shared.embedding, shared.fingerprint = embedded.embedding, embedded.fingerprint
            feed.publish(shared)
        self._embed_later(record, with_embedding)

    def _absorb_shared(self) -> None:
        """Add the donors other instances announced (on this thread, which owns the catalog)."""
        if self.feed is None:
            return
        counts = self.feed.take_counts()
        for name, counter in (("published", "donors_published"),
                              ("publish_failures", "shared_publish_failures"),
                              ("dropped", "shared_records_dropped"),
                              ("forged", "shared_records_forged"),
                              ("unready", "shared_records_unready"),
                              ("outages", "shared_index_outages")):
            if counts.get(name):
                self.stats.add(counter, counts[name])
        for shared in self.feed.take_arrived():
            try:
                self._add_shared(shared)
            except Exception as exc:   # a malformed record costs that record, nothing more
                self.stats.add("shared_records_dropped")
                warn_once(logger, "shared_record", "SemShare: a shared donor record was not "
                          "usable: %s", exc)

    def _add_shared(self, shared: SharedDonor) -> None:
        key = DonorKey(shared.namespace, shared.donor_id)
        tokens = shared.token_ids
        if not tokens or donor_id_for(shared.namespace, tokens) != shared.donor_id:
            self.stats.add("shared_records_dropped")   # not what its id says it is
            return
        if len(shared.kv_digests) != self.geometry.tp_size:
            self.stats.add("shared_records_dropped")   # its KV could not be checked on fetch
            return
        if key in self.index or self.index.covers(shared.namespace, tokens):
            return
        n = len(tokens)
        record = DonorRecord(key, tokens, self.geometry.donor_bytes(n),
                             block_hashes(tokens, self.geometry.block_size),
                             num_prompt_tokens=min(max(shared.num_prompt_tokens, 1), n),
                             kv_digests=list(shared.kv_digests))
        evicted = self.index.add(record)
        if key in evicted:
            return
        self._evict(evicted)
        self.stats.add("donors_shared_in")
        same_embedder = self.discovery is not None and shared.embedding is not None and \
            shared.embedder_id == self.discovery.embedder_id
        if not same_embedder:
            self._embed_later(record)   # embedded here, as a donor captured here would be
        elif self.index.set_embedding(key, record.serial, shared.embedding,
                                      shared.fingerprint):
            self.stats.add("donors_embedded")
            self._prepare_alignment(record)

    def report_deviation(self, key: DonorKey, deviation: float) -> None:
        """The recompute stage's measured deviation (0-1) of one reuse of donor ``key``."""
        self._evict(self.index.report_deviation(key, deviation))
        self._snapshot_dirty = True

    def _maybe_snapshot(self, force: bool = False) -> Future | None:
        root = self._persist_root
        if self.discovery is None or root is None or not self._snapshot_dirty:
            return None
        if not force and time.monotonic() - self._snapshot_at < SNAPSHOT_INTERVAL_S:
            return None
        self._snapshot_dirty, self._snapshot_at = False, time.monotonic()
        records = [r for r in self.index.records() if r.embedding is not None]
        embedder_id = self.discovery.embedder_id

        def write():  # on the discovery thread: entries are built there too
            now = time.monotonic()
            write_snapshot(root, [SnapshotEntry(
                r.key.namespace, r.key.donor_id, r.embedding, r.fingerprint, r.hits,
                now - r.last_used, r.deviation_reports, r.deviation, r.demoted)
                for r in records], embedder_id)
        return self.discovery.write_snapshot(write)

    def shutdown(self) -> None:
        if self.feed is not None:
            self.feed.close()
        if self.discovery is None:
            return
        self.discovery.stop_registrations()  # a backlog of donors must not delay shutdown
        self._absorb_embeddings()
        pending = self._maybe_snapshot(force=True)
        if pending is not None:
            try:
                pending.result(timeout=60)
            except Exception:
                pass  # logged by the service
        self.discovery.close()

    # ---- hit path -----------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        try:
            return self._match(request, num_computed_tokens)
        except Exception:  # a connector fault costs this request its reuse, nothing more
            self._fault("lookup")
            return 0, False

    def _match(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        self._matches.pop(request.request_id, None)
        if self.geometry.unsupported:
            return 0, False
        if not keyable(request):    # prompt embeddings: their token ids say nothing
            if request.request_id not in self._looked_up:
                self._looked_up.add(request.request_id)
                self.stats.add("unkeyable_requests")
            return 0, False
        mode = reuse_mode(request)
        if mode != "auto" and request.request_id not in self._looked_up:
            self.stats.add("reuse_opt_outs" if mode in ("off", "exact") else "reuse_forced")
        scoring = prefix_cache_flags.wants_cache_skip(request)
        if scoring and not (wants_prompt_logprobs(request) and reuse_limit(request) is not None):
            mode = "off"      # vLLM would drop the claim (prompt logprobs, pooling): no lookup
        if mode == "off":
            self._looked_up.add(request.request_id)
            return 0, False
        if scoring:
            # Prompt logprobs with a reuse limit. Right after asking us, vLLM drops our answer
            # (a claim, or "wait" for the search) for requests that skip reading caches: clear the
            # flag for this step, and have the worker mark the rows it serves. It is set back once
            # a claim is allocated, or at the end of the step, so that vLLM's own prefix cache
            # (looked up before us) never serves such a request.
            prefix_cache_flags.allow_connector_claim(request)
            self._scoring[request.request_id] = request
        if request.request_id not in self._looked_up:  # vLLM re-asks while it cannot schedule
            self._looked_up.add(request.request_id)
            self.stats.add("lookups")
            self.stats.add("lookup_tokens", request.num_tokens - num_computed_tokens)
        self._absorb_embeddings()
        match = self.index.longest_prefix(namespace_of(request), request.all_token_ids)
        limit = self._claim_limit(request)
        end = min(match.num_tokens, limit) if match is not None else 0
        if self._await_lookup(request, nothing_left=max(end, num_computed_tokens) >= limit):
            return None, False
        claim = end - num_computed_tokens
        plan = self._semantic(request, num_computed_tokens, max(claim, 0))
        if plan is _WAIT:
            return None, False
        if plan is not None and not self._make_request_only(request, plan.start):
            warn_once(logger, "request_only", "SemShare: this vLLM's requests have no block hasher "
                      "the connector can wrap; semantic reuse is off")
            plan = None
        if plan is not None:
            self._matches[request.request_id] = plan
            return plan.num_tokens, False
        if match is None or claim < max(self.config.min_reuse_tokens, 1):
            return 0, False
        self._matches[request.request_id] = PrefixMatch(match.key, end)
        return claim, False

    # ---- semantic hits ------------------------------------------------------------------------
    def _semantic(self, request, num_computed: int, exact_claim: int):
        """A ``SemanticPlan`` for the request, ``_WAIT`` while its alignment runs, or None."""
        rid = request.request_id
        found = self.found.get(rid)
        mode = reuse_mode(request)
        if (found is None and rid not in self._aligning and rid not in self._aligned) or \
                self.aligner is None or not self.recompute_ready or mode in ("off", "exact") \
                or not semantic_allowed(request):
            return None
        if rid not in self._aligned:
            job = self._aligning.get(rid)
            if job is None:
                donors = [(c.key, list(self.index.get(c.key).token_ids))
                          for c in found.candidates if self.index.get(c.key) is not None]
                if not donors:
                    return None
                target = list(request.all_token_ids[:request.num_prompt_tokens])
                aligner = self.aligner
                job = (self.discovery.run(lambda: aligner.best(target, num_computed, donors)),
                       time.monotonic())
                self._aligning[rid] = job
            future, started = job
            if not future.done():
                if time.monotonic() < started + self.config.lookup_deadline_ms / 1e3:
                    return _WAIT
                future.cancel()
                del self._aligning[rid]
                self.found.pop(rid, None)
                self.stats.add("align_timeouts")
                return None
            del self._aligning[rid]
            self.found.pop(rid, None)
            if future.cancelled() or future.exception() is not None or future.result() is None:
                return None
            self._aligned[rid] = future.result()
            self.stats.add("align_ms", (time.monotonic() - started) * 1e3)
        key, al = self._aligned[rid]
        record = self.index.get(key)
        if record is None or record.demoted or key.namespace != namespace_of(request):
            self._aligned.pop(rid, None)
            return None
        end = request.num_prompt_tokens - 1          # vLLM computes the last prompt token
        limit = reuse_limit(request)
        if limit is not None:
            end = min(end, limit)
        if end - num_computed <= max(exact_claim, self.config.min_reuse_tokens - 1):
            return None
        if coverage(al, num_computed, end) < self.config.min_alignment_coverage and \
                mode != "semantic":
            return None
        return plan_claim(key, al, num_computed, end, self.config.recompute_run_head,
                          self.config.recompute_tail)

    def _make_request_only(self, request, start: int) -> bool:
        """Keep approximate KV out of vLLM's exact prefix cache: every block hash the request has
        or will get from the block holding ``start`` on is salted per request
        (``vllm_compat.block_hashes``), so the blocks vLLM caches for it (right after
        allocation, before the load, and as decoding fills them) are never another request's
        exact hit. False: this vLLM cannot be kept apart; make no approximate claim."""
        return vllm_block_hashes.make_request_only(request, start, self.geometry.block_size)

    def _claim_limit(self, request) -> int:
        """vLLM must compute at least one token itself, and our claims end on a block boundary."""
        bs = self.geometry.block_size
        limit = reuse_limit(request)
        end = request.num_tokens - 1 if limit is None else min(request.num_tokens - 1, limit)
        return (end // bs) * bs

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        match = self._matches.get(request.request_id)
        try:
            self._after_alloc(request, blocks, num_external_tokens)
        except Exception:
            # vLLM now counts these tokens as loaded: the worker must report their blocks failed
            # so that vLLM computes them; nothing else may come of a fault here.
            self._fault("load planning")
            if num_external_tokens:
                # where the claim starts (vLLM sets num_computed_tokens only after this call);
                # unknown: every block of the request is reported
                if isinstance(match, SemanticPlan):
                    start = match.start
                elif isinstance(match, PrefixMatch):
                    start = max(match.num_tokens - num_external_tokens, 0)
                else:
                    start, num_external_tokens = 0, request.num_tokens
                block_ids = list(blocks.get_block_ids()[0])
                self._remember_load(request.request_id, block_ids, start)
                self._loads.append(LoadSpec(
                    req_id=request.request_id, key=DonorKey("", ""), src_start=0,
                    dst_start=start, num_tokens=num_external_tokens, block_ids=block_ids,
                    policy="fail"))

    def _after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self._loaded_blocks.pop(request.request_id, None)   # (re-allocated after preemption)
        scoring = self._scoring.pop(request.request_id, None) is not None
        if scoring:
            prefix_cache_flags.restore_cache_skip(request)
        match = self._matches.pop(request.request_id, None)
        if num_external_tokens == 0 or match is None:
            return
        block_ids = list(blocks.get_block_ids()[0])
        if isinstance(match, SemanticPlan):
            plan = match if num_external_tokens >= match.num_tokens else \
                match.truncated(num_external_tokens)     # vLLM took less than offered
            spec = LoadSpec(
                req_id=request.request_id, key=plan.key, src_start=0, dst_start=plan.start,
                num_tokens=plan.num_tokens, block_ids=block_ids,
                policy=self.config.recompute_policy, always=plan.always,
                token_ids=list(request.all_token_ids[:plan.end]), donor_pos=plan.donor_pos)
            self._aligned.pop(request.request_id, None)
            self.stats.add("semantic_hits")
            self.stats.add("exact_reused_tokens", plan.exact_tokens)
            self.stats.add("fuzzy_reused_tokens", plan.fuzzy_tokens)
            self._approximate.add(request.request_id)
        else:
            start = match.num_tokens - num_external_tokens
            spec = LoadSpec(
                req_id=request.request_id, key=match.key, src_start=start, dst_start=start,
                num_tokens=num_external_tokens, block_ids=block_ids)
            if self.config.recompute_policy == "all" and not self.geometry.exact_only:  # not fp8
                spec.policy = "all"
                spec.token_ids = list(request.all_token_ids[:start + num_external_tokens])
        if scoring:
            spec.mark_logprobs_until = spec.dst_start + spec.num_tokens
        self._remember_load(request.request_id, block_ids, spec.dst_start)
        self.index.touch(spec.key)
        record = self.index.get(spec.key)
        if record is not None:
            record.hits += 1
            if self.config.kv_tier != "host":   # the worker may have to fetch it from there
                spec.donor_token_ids = list(record.token_ids)
                if record.kv_digests:            # another instance's: what it must fetch
                    spec.donor_kv_digests = list(record.kv_digests)
        self.stats.add("hits")
        self.stats.add("hit_tokens", spec.num_tokens)
        self._loads.append(spec)     # last: a fault above leaves only the "fail" load

    def build_connector_meta(self, scheduler_output) -> SemShareConnectorMetadata:
        meta = SemShareConnectorMetadata(evictions=self._evictions, captures=self._captures,
                                         loads=self._loads)
        self._evictions, self._captures, self._loads = [], [], []
        self._matches.clear()
        for request in self._scoring.values():    # offered, not allocated this step
            prefix_cache_flags.restore_cache_skip(request)
        self._scoring.clear()
        self._absorb_embeddings()
        self._absorb_shared()
        self._maybe_snapshot()
        return meta

    # ---- capture ------------------------------------------------------------------------------
    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict | None]:
        self._looked_up.discard(request.request_id)
        self.found.pop(request.request_id, None)
        self._aligned.pop(request.request_id, None)
        loaded = self._loaded_blocks.pop(request.request_id, None)
        if loaded is not None:
            self._finished_loads[request.request_id] = (loaded, FAILURE_REPORT_OUTPUTS)
        job = self._aligning.pop(request.request_id, None)
        if job is not None:
            job[0].cancel()
        failed = request.request_id in self._failed_loads
        self._failed_loads.discard(request.request_id)
        if request.request_id in self._approximate or failed:
            # Approximate KV never becomes a donor (error must not compound), nor does a request
            # whose load failed (vLLM may not have recomputed the blocks before it ended).
            self._approximate.discard(request.request_id)
            return False, None
        pending = self._lookups.pop(request.request_id, None)
        if pending is not None:
            pending.future.cancel()
        try:
            return self._capture_on_finish(request, block_ids)
        except Exception:  # nothing was queued before the fault: vLLM frees the blocks now
            self._fault("capture")
            return False, None

    def _fault(self, where: str) -> None:
        self.stats.add("fallbacks")
        if where not in self._faults_logged:
            self._faults_logged.add(where)
            logger.exception("SemShare: %s failed; the request is computed as usual (logged "
                             "once, counted in stats as fallbacks)", where)

    def _capture_on_finish(self, request, block_ids: list[int]) -> tuple[bool, dict | None]:
        if not self.config.capture or self.geometry.unsupported or reuse_mode(request) == "off" \
                or not keyable(request):
            return False, None
        # The KV of the last token is never computed (it was just sampled); with async
        # scheduling num_computed_tokens may already count it.
        n = min(request.num_computed_tokens, request.num_tokens - 1)
        if n < self.config.min_donor_tokens:
            return False, None
        namespace = namespace_of(request)
        token_ids = list(request.all_token_ids[:n])
        if self.index.covers(namespace, token_ids):
            return False, None
        bs = self.geometry.block_size
        blocks = list(block_ids[: (n + bs - 1) // bs])
        if len(blocks) * bs < n:  # should not happen; never read blocks we do not hold
            return False, None
        key = DonorKey(namespace, donor_id_for(namespace, token_ids))
        record = DonorRecord(key, token_ids, self.geometry.donor_bytes(n),
                             block_hashes(token_ids, bs),
                             num_prompt_tokens=min(request.num_prompt_tokens, n))
        evicted = self.index.add(record)
        if key in evicted:  # larger than the whole store
            return False, None
        self._evict(evicted)
        self._embed_and_announce(record)
        self._captures.append(CaptureSpec(request.request_id, key, token_ids, blocks))
        self._capturing.add(request.request_id)
        self.stats.add("donors_registered")
        return True, None

    def has_pending_block_frees(self) -> bool:
        return bool(self._capturing)

    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        self._kv_cache_manager = kv_cache_manager

    def update_connector_output(self, connector_output) -> None:
        for req_id in connector_output.finished_sending or ():
            self._capturing.discard(req_id)
        invalid = getattr(connector_output, "invalid_block_ids", None)
        if invalid:
            self._forget_failed_loads(invalid)
        for req_id, (blocks, left) in list(self._finished_loads.items()):
            if left <= 1:
                del self._finished_loads[req_id]
            else:
                self._finished_loads[req_id] = (blocks, left - 1)
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, SemShareWorkerMetadata) and meta.disabled and \
                not self.geometry.unsupported:
            # A worker turned itself off (a layout it cannot address, no pool): its loads would
            # all fail. No more claims, captures or lookups (each checks ``unsupported``).
            self.geometry = replace(self.geometry, unsupported=f"worker: {meta.disabled}")
            logger.warning("SemShare disabled by the worker: %s; requests are computed as usual",
                           meta.disabled)
        if isinstance(meta, SemShareWorkerMetadata) and meta.recompute_ready is not None:
            self.recompute_ready = meta.recompute_ready
        if isinstance(meta, SemShareWorkerMetadata):
            for key, deviation in meta.deviations:   # feeds the "divergence" eviction policy
                if key in self.index:
                    self.report_deviation(key, min(1.0, deviation))
        if isinstance(meta, SemShareWorkerMetadata):
            if meta.capacity_bytes is not None:
                self._evict(self.index.shrink(meta.capacity_bytes))
            for key in meta.bad_donors:
                if self.index.remove(key) is not None:
                    self.stats.add("donors_evicted")
                self._evictions.append(key)

    def _remember_load(self, req_id: str, block_ids: list[int], start: int) -> None:
        """The request's blocks from the one holding ``start`` (the first a load writes) on."""
        self._loaded_blocks[req_id] = block_ids[start // self.geometry.block_size:]

    def _forget_failed_loads(self, invalid: set[int]) -> None:
        """A load failed (the worker reported its blocks): vLLM's ``recompute`` policy keeps
        those blocks cached for the request to recompute, but a request preempted or aborted
        first would leave never-written KV under its true hashes. Take the failed blocks, and
        every block computed after them from that KV, out of vLLM's prefix cache, and never
        capture the request."""
        finished = ((r, blocks) for r, (blocks, _) in self._finished_loads.items())
        for req_id, blocks in [*self._loaded_blocks.items(), *finished]:
            bad = next((i for i, b in enumerate(blocks) if b in invalid), None)
            if bad is None:
                continue
            if req_id in self._loaded_blocks:    # (a finished one is past capturing)
                self._failed_loads.add(req_id)
            vllm_block_hashes.evict_cached(self._kv_cache_manager, blocks[bad:])
            self.stats.add("failed_blocks_uncached", len(blocks) - bad)

    def _evict(self, keys: list[DonorKey]) -> None:
        if keys:
            self._evictions.extend(keys)
            self.stats.add("donors_evicted", len(keys))
            self._snapshot_dirty = True

    def _embed_later(self, record: DonorRecord, then=None) -> None:
        """Embed the donor on the discovery thread (``then(embedded)`` runs there after)."""
        if self.discovery is not None and record.serial and record.key in self.index:
            self.discovery.register(record.key, record.serial, record.prompt_token_ids, then)
            self._prepare_alignment(record)

    def _prepare_alignment(self, record: DonorRecord) -> None:
        if self.discovery is not None and self.aligner is not None:
            aligner, key, tokens = self.aligner, record.key, record.prompt_token_ids
            self.discovery.run_background(lambda: aligner.prepare(key, tokens))

    # ---- persistence --------------------------------------------------------------------------
    def _restore(self, root: Path) -> None:
        """Index the donors persisted under ``root`` (headers only; data is checked on load)."""
        if not root.is_dir():
            return
        for partial in donor_file.stale_partials(root):   # a writer killed mid-write
            try:
                partial.unlink(missing_ok=True)
                self.stats.add("persisted_incomplete")
            except OSError as exc:     # another user's file: left, never read
                warn_once(logger, "partial", "SemShare: cannot remove %s: %s", partial, exc)
        tp = self.geometry.tp_size
        files = sorted(root.glob(f"*.tp0of{tp}{donor_file.SUFFIX}"),
                       key=lambda p: p.stat().st_mtime)
        for path in files:
            try:
                header = donor_file.read_header(path)
                for rank in range(1, tp):
                    donor_file.read_header(donor_file.donor_path(root, header.donor_id, rank, tp))
                if (donor_id_for(header.namespace, header.token_ids) != header.donor_id
                        or list(self.geometry.layer_names) != header.layer_names):
                    raise donor_file.CorruptDonorFile(f"{path}: identity does not match contents")
            except donor_file.CorruptDonorFile as exc:
                warn_once(logger, "restore", "SemShare: skipping persisted donor: %s", exc)
                self.stats.add("persisted_skipped")
                continue
            key = DonorKey(header.namespace, header.donor_id)
            n = len(header.token_ids)
            self._evict(self.index.add(DonorRecord(
                key, header.token_ids, self.geometry.donor_bytes(n),
                block_hashes(header.token_ids, self.geometry.block_size))))
            self.stats.add("donors_restored")
        if len(self.index):
            logger.info("SemShare: restored %d donors from %s", len(self.index), root)
        if self.discovery is None:
            return
        saved = load_snapshot(root, self.discovery.embedder_id)
        for record in self.index.records():
            entry = saved.get((record.key.namespace, record.key.donor_id))
            if entry is None:
                self._embed_later(record)  # not in the snapshot: embed it again
                continue
            record.hits, record.deviation_reports = entry.hits, entry.deviation_reports
            record.deviation, record.demoted = entry.deviation, entry.demoted
            record.last_used = self.index.clock() - entry.idle_s
            self.index.set_embedding(record.key, record.serial, entry.embedding,
                                     entry.fingerprint)
