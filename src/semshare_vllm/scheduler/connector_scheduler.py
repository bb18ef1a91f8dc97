"""The scheduler half (EngineCore process): vLLM's scheduler-side connector callbacks, and only
those. Each step of the hit path lives in its own module of this package:

* ``request_params``: what the request asks of us (``kv_transfer_params``);
* ``semantic_search``: the donor search started on arrival, then the alignment (``planner``);
* ``loads``: the worker's load for what vLLM allocated, and the blocks watched for its failure;
* ``capture``: which finished requests become donors;
* ``provenance``: what served each request, returned to the client when it finishes;
* ``sharing`` / ``persistence``: donors across instances and restarts.

One ``RequestState`` per live request; the catalog (``DonorCatalog``) is changed only on this
thread. A fault in a callback costs that request its reuse (``logs.guarded``), never the request.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import replace

from semshare_vllm.catalog.donor_index import DonorIndex, PrefixMatch
from semshare_vllm.catalog.eviction import make_policy
from semshare_vllm.catalog.shared_index import SharedDonorFeed
from semshare_vllm.config import SemShareConfig
from semshare_vllm.core.counters import StatsRecorder
from semshare_vllm.core.identity import keyable, namespace_of
from semshare_vllm.discovery.service import DiscoveryService
from semshare_vllm.layout.geometry import KVGeometry
from semshare_vllm.logs import guarded, warn_once
from semshare_vllm.metadata import (
    CaptureSpec,
    FailedLoad,
    LoadSpec,
    SemShareConnectorMetadata,
    SemShareHandshake,
    SemShareWorkerMetadata,
)
from semshare_vllm.scheduler.capture import donor_for
from semshare_vllm.scheduler.donor_catalog import DonorCatalog
from semshare_vllm.scheduler.loads import (
    LoadWatch,
    failed_load,
    hold_back_every_repair,
    hold_back_unwritten_prefix,
    load_spec,
)
from semshare_vllm.scheduler.persistence import Snapshots, restore
from semshare_vllm.scheduler.planner import Aligner, SemanticPlan
from semshare_vllm.scheduler.provenance import Provenance
from semshare_vllm.scheduler.request_params import (
    claim_limit,
    reuse_limit,
    reuse_mode,
    wants_prompt_logprobs,
)
from semshare_vllm.scheduler.request_state import RequestState, Served
from semshare_vllm.scheduler.semantic_gate import semantic_refusal
from semshare_vllm.scheduler.semantic_search import WAIT, SemanticSearch
from semshare_vllm.scheduler.sharing import DonorSharing
from semshare_vllm.store.donor_file import persist_root
from semshare_vllm.vllm_compat import block_hashes as vllm_block_hashes
from semshare_vllm.vllm_compat import prefix_cache_flags, prefix_cache_reset, step_blocks
from semshare_vllm.vllm_compat.prefill_stats import local_cache_hit

logger = logging.getLogger("vllm.semshare.scheduler")


class SemShareScheduler:
    logger = logger

    def __init__(
        self,
        config: SemShareConfig,
        geometry: KVGeometry,
        discovery: DiscoveryService | None = None,
        aligner: Aligner | None = None,
        feed: SharedDonorFeed | None = None,
        stats: StatsRecorder | None = None,
    ):
        self.config = config
        self.geometry = geometry
        # the same recorder discovery and the feed count into, from their own threads
        self.stats = StatsRecorder() if stats is None else stats
        # Exact prefixes only (quantised KV, tensor parallelism): no donor search, so no
        # semantic claim.
        refused = semantic_refusal(config, geometry)
        self.discovery = None if geometry.unsupported or refused else discovery
        policy = make_policy(
            config.eviction_policy,
            half_life_s=config.decay_half_life_s,
            threshold=config.divergence_threshold,
        )
        # The worker's pool reports its real size in its first step (update_connector_output).
        self.catalog = DonorCatalog(
            DonorIndex(
                geometry.block_size,
                config.host_store_bytes,
                policy,
                self.discovery.index if self.discovery else None,
            ),
            self.stats,
        )
        self.search = (
            None
            if self.discovery is None
            else SemanticSearch(
                config, geometry.block_size, self.catalog, self.discovery, aligner, self.stats
            )
        )
        self.sharing = DonorSharing(
            None if geometry.unsupported else feed, geometry, self.catalog, self.search, self.stats
        )
        self.load_watch = LoadWatch(geometry.block_size, self.stats)
        self.provenance = Provenance(self.stats, config.shared_index_secret)
        self._load_seq = itertools.count(1)  # LoadSpec.seq: the worker's figures name their load
        self.requests: dict[str, RequestState] = {}
        self.recompute_ready = False  # the worker said it can repair
        self.workers_confirmed = 0  # workers whose start-up fingerprint is this one's
        self._offered: list[RequestState] = []  # offers (or scoring flags) this step
        self._loads: list[LoadSpec] = []
        self._failed_loads: list[FailedLoad] = []
        self._captures: list[CaptureSpec] = []
        # finished requests whose blocks vLLM keeps for our capture, until the worker says so
        self._capturing: dict[str, object] = {}
        # of those, whose blocks went back to vLLM (a reset of its prefix cache): until the
        # worker's report, each step copies captures before it writes (``captures_released``)
        self._given_back: set[str] = set()
        self._reset = False  # vLLM reset the connector: the worker drops everything next step
        self._epoch = 0  # resets so far (``RequestState.epoch``)
        root = persist_root(config.persist_dir, geometry)
        self.snapshots = (
            None
            if root is None or self.search is None
            else Snapshots(root, self.catalog, self.search)
        )
        if geometry.unsupported:
            logger.warning(
                "SemShare disabled for this model: %s; requests are computed as usual",
                geometry.unsupported,
            )
            return
        if refused:
            logger.warning("SemShare: exact-prefix reuse only: %s", refused)
        if geometry.local_only and (
            config.persist_dir or config.shared_index_url or config.kv_tier != "host"
        ):
            logger.warning(
                "SemShare: donors stay in this process (persist_dir, the shared index and "
                "LMCache are off): %s",
                geometry.local_only,
            )
        if root is not None:
            try:
                restore(root, geometry, self.catalog, self.search, self.stats)
            except Exception:  # files are others' too: never a reason not to start
                logger.warning(
                    "SemShare: restoring the donors persisted in %s stopped; serving those "
                    "read so far",
                    root,
                    exc_info=True,
                )

    @property
    def index(self) -> DonorIndex:
        return self.catalog.index

    def _state(self, request) -> RequestState:
        state = self.requests.get(request.request_id)
        if state is None:
            state = RequestState(request.request_id, epoch=self._epoch)
            self.requests[request.request_id] = state
        return state

    # ---- a request arrives --------------------------------------------------------------------
    @guarded("discovery")
    def on_new_request(self, request) -> None:
        self._absorb()  # donors embedded or shared while the engine was idle join the index
        if self.search is not None and not self.geometry.unsupported:
            self.search.start(request, self._state(request))  # runs off this thread

    # ---- vLLM asks how many tokens we can provide ---------------------------------------------
    @guarded("lookup", (0, False))
    def get_num_new_matched_tokens(
        self, request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        state = self._state(request)
        state.offer = None
        state.local_hit = num_computed_tokens  # vLLM's own hit, block-aligned
        if self.geometry.unsupported:
            return 0, False
        if self.load_watch.behind_unconfirmed(request, num_computed_tokens):
            # vLLM's hit holds blocks a load of ours may not have written: ask again next step
            self.stats.add("waits_behind_unconfirmed_loads")
            return None, False
        if state.load_failed:
            # Admitted again after its load failed (vLLM preempts a request whose next step
            # already ran over the failed load, ``in_flight_failures``): vLLM computes it, and
            # the same claim cannot fail it twice.
            return 0, False
        if not keyable(request):  # prompt embeddings: their token ids say nothing
            if not state.counted:
                state.counted = True
                self.stats.add("unkeyable_requests")
            return 0, False
        mode = reuse_mode(request)
        if mode != "auto" and not state.counted:
            self.stats.add("reuse_opt_outs" if mode in ("off", "exact") else "reuse_forced")
        scoring = prefix_cache_flags.wants_cache_skip(request)
        if scoring and not (wants_prompt_logprobs(request) and reuse_limit(request) is not None):
            mode = "off"  # vLLM would drop the claim (prompt logprobs, pooling): no lookup
        elif scoring and request.num_output_tokens > 0:
            # Resumed after a preemption: its prompt logprobs went out with its first token and
            # the runner keeps no rows for it. A claim would mark rows that are gone, fail, and
            # restart them: every prompt logprob sent twice. vLLM computes it, as without us.
            mode = "off"
        if mode == "off":
            state.counted = True
            return 0, False
        if scoring:
            # Prompt logprobs with a reuse limit. Right after asking us, vLLM drops our answer
            # (a claim, or "wait" for the search) for requests that skip reading caches: clear
            # the flag for this step, and have the worker mark the rows it serves. It is set back
            # once a claim is allocated, or at the end of the step, so that vLLM's own prefix
            # cache (looked up before us) never serves such a request.
            prefix_cache_flags.allow_connector_claim(request)
            state.scoring = request
            self._offered.append(state)
        if not state.counted:  # vLLM re-asks while it cannot schedule the request
            state.counted = True
            self.stats.add("lookups")
            self.stats.add("lookup_tokens", request.num_tokens - num_computed_tokens)
        if self.search is not None:
            self.search.absorb_embeddings()
        match = self.index.longest_prefix(namespace_of(request), request.all_token_ids)
        limit = claim_limit(request, self.geometry.block_size)
        end = min(match.num_tokens, limit) if match is not None else 0
        claim = end - num_computed_tokens
        plan = None
        if self.search is not None:
            nothing_left = max(end, num_computed_tokens) >= limit
            if self.search.poll_lookup(request, state, nothing_left):
                return None, False
            plan = self.search.plan(
                request, state, num_computed_tokens, max(claim, 0), self.recompute_ready
            )
            if plan is WAIT:
                return None, False
        if plan is not None and not vllm_block_hashes.make_request_only(
            request, plan.start, self.geometry.block_size
        ):
            # Approximate KV must stay out of vLLM's exact prefix cache.
            warn_once(
                logger,
                "request_only",
                "SemShare: this vLLM's requests have no block hasher "
                "the connector can wrap; semantic reuse is off",
            )
            plan = None
        if plan is not None:
            self._offer(state, plan)
            return plan.num_tokens, False
        if match is None or claim < max(self.config.min_reuse_tokens, 1):
            return 0, False
        self._offer(state, PrefixMatch(match.key, end))
        return claim, False

    def _offer(self, state: RequestState, offer: PrefixMatch | SemanticPlan) -> None:
        state.offer = offer
        self._offered.append(state)

    # ---- vLLM allocated blocks for what we offered --------------------------------------------
    @guarded("load planning", on_fault="_report_unplanned_load")
    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        state = self._state(request)
        state.loaded_blocks, state.marks_logprobs = None, False  # (again after preemption)
        # what serves this admission (a preempted request is admitted again)
        hit = local_cache_hit(request)
        earlier, state.served = (
            state.served,
            Served(vllm_cached_tokens=state.local_hit if hit is None else hit),
        )
        scoring = state.scoring is not None
        if scoring:
            prefix_cache_flags.restore_cache_skip(request)
        offer = state.offer
        if num_external_tokens == 0 or offer is None:
            if state.approximate and earlier.kind == "semantic":
                # Admitted again with no load: its answer so far came from the donor's KV,
                # and vLLM's cache may serve its own approximate blocks back (salted).
                earlier.vllm_cached_tokens = state.served.vllm_cached_tokens
                state.served = earlier
            state.scoring = None
            return
        block_ids = list(blocks.get_block_ids()[0])
        spec = load_spec(request, offer, block_ids, num_external_tokens, self.config, self.geometry)
        spec.seq = next(self._load_seq)
        served = state.served
        served.kind = "semantic" if isinstance(offer, SemanticPlan) else "exact"
        served.tokens, served.donor = spec.num_tokens, spec.key
        served.policy, served.seq = spec.policy, spec.seq
        if spec.policy != "none":  # a repair the gate may escalate (``report_escalation``)
            served.target = state.served_prompt(request).digest
        if isinstance(offer, SemanticPlan):
            state.aligned, state.approximate = None, True
            self.stats.add("semantic_hits")
            self.stats.add("exact_reused_tokens", offer.exact_tokens)
            self.stats.add("fuzzy_reused_tokens", offer.fuzzy_tokens)
        if scoring:
            spec.mark_logprobs_until = spec.dst_start + spec.num_tokens
            state.marks_logprobs = True
        self.load_watch.watch(state, block_ids, spec.dst_start)
        self.load_watch.unconfirmed(spec.seq, request, block_ids, spec.dst_start)
        self.index.touch(spec.key)
        record = self.index.get(spec.key)
        if record is not None:
            record.hits += 1
            if self.config.kv_tier != "host":  # the worker may have to fetch it from there
                spec.donor_token_ids = list(record.token_ids)
                if record.kv_digests:  # another instance's: what it must fetch
                    spec.donor_kv_digests = list(record.kv_digests)
        self.stats.add("hits")
        self.stats.add("hit_tokens", spec.num_tokens)
        self._loads.append(spec)  # last: a fault above leaves only the failed load
        state.offer = state.scoring = None

    def _report_unplanned_load(self, request, blocks, num_external_tokens: int) -> None:
        """vLLM now counts these tokens as loaded: the worker must report their blocks failed,
        so that vLLM computes them."""
        if num_external_tokens:
            state = self._state(request)
            block_ids = list(blocks.get_block_ids()[0])
            failed = failed_load(request, state.offer, block_ids, num_external_tokens)
            self.load_watch.watch(state, block_ids, failed.start)
            self._failed_loads.append(failed)

    # ---- once per step ------------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output) -> SemShareConnectorMetadata:
        loads, held = self._loads_to_run(scheduler_output)
        meta = SemShareConnectorMetadata(
            evictions=self.catalog.take_evictions(),
            captures=self._captures,
            loads=loads,
            failed_loads=self._failed_loads + held,
            restart_logprob_rows=self.load_watch.take_logprob_restarts(),
            reset=self._reset,
            captures_released=bool(self._given_back),
        )
        if meta.reset or meta.captures_released or meta.restart_logprob_rows:
            # before the forward: it may write into released blocks, and its prompt logprobs
            # must come after the restart
            step_blocks.start_before_forward(scheduler_output)
        self._captures, self._loads, self._failed_loads = [], [], []
        self._reset = False
        # Backstop: the last output's provenance is settled (vLLM asked for stats after it),
        # and nothing may write into a dict vLLM has sent.
        self.provenance.settle()
        for state in self._offered:  # offered, not allocated this step
            if state.scoring is not None:
                prefix_cache_flags.restore_cache_skip(state.scoring)
            state.offer = state.scoring = None
        self._offered = []
        self._housekeeping()
        return meta

    def _loads_to_run(self, scheduler_output) -> tuple[list[LoadSpec], list[FailedLoad]]:
        """This step's loads, less those whose repair would read a prefix the step has yet to
        write, reported failed instead (``hold_back_unwritten_prefix``); where that cannot be
        told (a fault), every repaired load: never a repair over KV not known to exist. The
        blocks of every load this step reports failed leave vLLM's prefix cache now: with async
        scheduling the next step is scheduled before the failure comes back, and its requests
        would take them as written."""
        split = self._split_loads(scheduler_output)
        loads, held = hold_back_every_repair(self._loads) if split is None else split
        if held:
            self.stats.add("loads_behind_unwritten_prefix", len(held))
            # their blocks leave vLLM's prefix cache below: nothing left to wait for
            running = {spec.seq for spec in loads}
            self.load_watch.confirmed(s.seq for s in self._loads if s.seq not in running)
        self._age_unconfirmed()
        for failed in self._failed_loads + held:
            vllm_block_hashes.evict_cached(
                self.load_watch.kv_cache_manager,
                failed.block_ids[failed.start // self.geometry.block_size :],
            )
        return loads, held

    @guarded("ageing unconfirmed loads")
    def _age_unconfirmed(self) -> None:
        self.load_watch.age_unconfirmed()  # (it evicts from vLLM's cache: never into schedule())

    @guarded("the step's prefix check")
    def _split_loads(self, scheduler_output):
        return hold_back_unwritten_prefix(
            self._loads,
            self._failed_loads,
            scheduler_output,
            self.load_watch.kv_cache_manager,
            self.geometry.block_size,
        )

    @guarded("housekeeping")
    def _housekeeping(self) -> None:
        self._absorb()
        if self.snapshots is not None:
            self.snapshots.maybe_write()

    def _absorb(self) -> None:
        if self.search is not None:
            self.search.absorb_embeddings()
        self.sharing.absorb()

    # ---- a request finished: keep it as a donor? ----------------------------------------------
    @guarded("capture", (False, None))
    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict | None]:
        """Whether vLLM keeps the blocks for the capture, and the request's provenance (what
        vLLM returns to the client as ``kv_transfer_params``)."""
        state = self.requests.pop(request.request_id, None) or RequestState(request.request_id)
        state.drop_job()
        self.load_watch.finished(state)
        params = self._provenance(request, state)
        if state.approximate or state.load_failed or state.epoch != self._epoch:
            # Approximate KV never becomes a donor (error must not compound), nor does a request
            # whose load failed (vLLM may not have recomputed the blocks before it ended), nor
            # one that was live at a reset (its KV may predate the reset).
            return False, params
        made = donor_for(request, block_ids, self.index, self.config, self.geometry)
        if made is None:
            return False, params
        record, capture = made
        if not self.catalog.add(record):  # larger than the whole store
            return False, params
        self.sharing.announce(record)
        self._captures.append(capture)
        self._capturing[request.request_id] = request
        self.stats.add("donors_registered")
        return True, params  # vLLM keeps its blocks until the worker copied them

    @guarded("provenance")
    def _provenance(self, request, state: RequestState) -> dict | None:
        return self.provenance.finished(request, state)

    def has_pending_block_frees(self) -> bool:
        return bool(self._capturing.keys() - self._given_back)

    # ---- start-up: what the workers loaded -----------------------------------------------------
    @guarded("comparing the workers' fingerprints", on_fault="_unconfirmed")
    def confirm_workers(self, reports: dict[int, object]) -> None:
        """vLLM's start-up handshake: each worker's ``SemShareHandshake``, of what it loaded.
        The fingerprint here was computed when this half was built; a worker whose fingerprint
        differs computes with other weights or settings (the model's files changed between its
        load and now), and one whose donors stay in its process says why. Either way this half
        restores, announces and takes in no donor from now on, and forgets those it restored (no
        request has run yet; their files stay, for the engines whose donors they are). A worker
        that computes under its own fingerprint still files its donors under it: they are right
        for the weights it holds. Reports of other connectors (vLLM's ``MultiConnector`` hands
        every connector the same ones) are not ours and are ignored."""
        ours = {r: h for r, h in reports.items() if isinstance(h, SemShareHandshake)}
        if self.geometry.unsupported or self.geometry.local_only or not ours:
            return
        why = None
        for rank, report in sorted(ours.items()):
            if report.local_only:
                why = f"worker {rank}: {report.local_only}"
            elif report.fingerprint != self.geometry.fingerprint:
                why = (
                    f"worker {rank} loaded a model other than the one this process identifies "
                    "now (its files or settings changed during start-up)"
                )
            if why is not None:
                break
        if why is None:
            self.workers_confirmed = len(ours)
            logger.info(
                "SemShare: %d worker(s) compute under this engine's fingerprint %s",
                self.workers_confirmed,
                self.geometry.fingerprint,
            )
            return
        dropped = self._keep_donors_in_process(why, drop_files=False)
        logger.warning(
            "SemShare: this engine restores and shares no donor (%d restored donors forgotten): %s",
            dropped,
            why,
        )

    def _unconfirmed(self, reports=None) -> None:
        """A fault in the comparison: nothing tells whether a restored donor is right for the
        workers' weights, so the connector claims and captures nothing (as ``_reset_failed``)."""
        self.geometry = replace(
            self.geometry, unsupported="the workers' fingerprints could not be compared"
        )

    # ---- vLLM resets the connector ------------------------------------------------------------
    @guarded("the connector reset", True, on_fault="_reset_failed")
    def reset_cache(self) -> bool:
        """vLLM's ``reset_prefix_cache(reset_connector=True)``: what its pause and sleep call,
        and reinforcement-learning loops around a weight update. True: vLLM may count the
        reset done."""
        self._forget_every_donor("connector reset by vLLM")
        return True

    @guarded("the reset after a weight update", on_fault="_reset_failed")
    def _weights_updated(self) -> None:
        """The worker saw the model's weights updated in place (its report): a reset, whether
        or not vLLM resets the connector too."""
        self._forget_every_donor("the model's weights were updated")

    def _forget_every_donor(self, why: str) -> None:
        """No donor of before may serve again: every one is forgotten here, and the worker
        drops its copies at its next step (persisted files and captures in flight included).
        No request live now becomes a donor (its KV may predate the reset). From now on this
        process persists and shares nothing (``KVGeometry.local_only``): its weights may no
        longer be those its files name."""
        self._reset = True  # first: whatever fails below, the worker drops everything
        self._epoch += 1
        dropped = self._keep_donors_in_process(
            f"{why}: the weights may no longer be those the model's files name", drop_files=True
        )
        self.stats.add("connector_resets")
        logger.warning(
            "SemShare: %s: %d donors dropped; from now on donors stay in this process "
            "(persist_dir, the shared index and LMCache are off)",
            why,
            dropped,
        )

    def _keep_donors_in_process(self, why: str, drop_files: bool) -> int:
        """Every donor forgotten (``drop_files``: the worker deletes their files too), and from
        now on none persisted, restored or shared (``KVGeometry.local_only``, ``why``); how many
        were forgotten."""
        dropped = self.catalog.clear(drop_files=drop_files)
        self.snapshots = None
        self.sharing.stop()
        self.geometry = replace(self.geometry, local_only=why)
        return dropped

    def _reset_failed(self) -> None:
        """A fault in the reset: the connector claims and captures nothing any more (each
        checks ``unsupported``), so no donor of before can serve."""
        self.geometry = replace(self.geometry, unsupported="a connector reset failed")

    # ---- what the worker reported -------------------------------------------------------------
    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        self.load_watch.kv_cache_manager = kv_cache_manager  # failed blocks leave its cache
        prefix_cache_reset.before_reset(kv_cache_manager, self._release_capture_blocks)

    @guarded("giving back the blocks held for captures")
    def _release_capture_blocks(self) -> None:
        """vLLM is about to reset its prefix cache, which it refuses (its pause and sleep
        raise) while any block is in use: the blocks it keeps for our captures go back now. The
        worker copies those captures at its next step before that step writes anything (or
        drops them, if the connector is reset too); vLLM forgets the requests on its report."""
        kv_cache_manager = self.load_watch.kv_cache_manager
        for req_id, request in self._capturing.items():
            # first: should the release fail, those before it are copied before any write
            self._given_back.add(req_id)
            prefix_cache_reset.release_blocks(kv_cache_manager, request)

    def update_connector_output(self, connector_output) -> None:
        for req_id in connector_output.finished_sending or ():
            self._capturing.pop(req_id, None)
            self._given_back.discard(req_id)
        self.load_watch.on_output(
            getattr(connector_output, "invalid_block_ids", None), self.requests
        )
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, SemShareWorkerMetadata):
            self._take_worker_report(meta)

    @guarded("worker report")
    def _take_worker_report(self, meta: SemShareWorkerMetadata) -> None:
        if meta.disabled and not self.geometry.unsupported:
            # A worker turned itself off (a layout it cannot address, no pool): its loads would
            # all fail. No more claims, captures or lookups (each checks ``unsupported``).
            self.geometry = replace(self.geometry, unsupported=f"worker: {meta.disabled}")
            logger.warning(
                "SemShare disabled by the worker: %s; requests are computed as usual", meta.disabled
            )
        if meta.weights_changed:
            self._weights_updated()
        if meta.recompute_ready is not None:
            self.recompute_ready = meta.recompute_ready
        self.load_watch.confirmed(meta.loads_done)
        for key, deviation in meta.deviations:  # feeds the "divergence" eviction policy
            if key in self.index:
                self.catalog.report_deviation(key, min(1.0, deviation))
        if meta.capacity_bytes is not None:
            self.catalog.evict(self.index.shrink(meta.capacity_bytes))
        for key in meta.bad_donors:
            self.catalog.drop_bad(key)
        for figures in meta.repairs:
            served = self.provenance.repaired(figures, self.requests)
            needed_more = figures.escalations or figures.declined
            if needed_more and served is not None and served.donor is not None:
                self.catalog.report_escalation(served.donor, served.target, figures.declined)

    def take_stats(self) -> dict | None:
        """The interval's counts, for vLLM's stats. vLLM asks once per ``update_from_output``,
        after ``update_connector_output``: this output's provenance is settled first, so that
        its histograms are in these counts and no dict it carries is written after."""
        self.provenance.settle()
        return self.stats.take()

    def shutdown(self) -> None:
        if self.sharing.feed is not None:
            self.sharing.feed.close()
        if self.search is None:
            return
        self.discovery.stop_registrations()  # a backlog of donors must not delay shutdown
        self.search.absorb_embeddings()
        pending = None if self.snapshots is None else self.snapshots.maybe_write(force=True)
        if pending is not None:
            try:
                pending.result(timeout=60)
            except Exception:
                pass  # logged by the service
        self.discovery.close()
