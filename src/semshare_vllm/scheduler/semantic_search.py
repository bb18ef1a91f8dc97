"""The discovery side of the scheduler half: a request's donor search and alignment, and making
new donors searchable.

A request's search starts when it arrives (``start``); each time vLLM asks for it, ``poll_lookup``
and then ``plan`` say whether it must wait for the job running on the discovery thread. Both jobs
(the search, then the alignment of the donors found) are polled the same way: the request waits
(vLLM re-asks next step) until its job is done or ``lookup_deadline_ms`` after the job started,
then goes on without it. The catalog is changed only here, on the scheduler thread: embeddings
computed on the discovery thread are attached by ``absorb_embeddings``.
"""

from __future__ import annotations

import time
import weakref

from semshare_vllm.catalog.donor_index import DonorRecord
from semshare_vllm.config import SemShareConfig
from semshare_vllm.core.counters import StatsRecorder
from semshare_vllm.core.identity import keyable, namespace_of, semantic_allowed
from semshare_vllm.discovery.service import DiscoveryService, Lookup
from semshare_vllm.scheduler.donor_catalog import DonorCatalog
from semshare_vllm.scheduler.planner import Aligner, SemanticPlan, coverage, plan_claim
from semshare_vllm.scheduler.request_params import (
    claim_limit,
    reusable_length,
    reusable_prompt,
    reuse_mode,
)
from semshare_vllm.scheduler.request_state import DiscoveryJob, RequestState, SemanticMatch

WAIT = object()  # "ask again next step": the request's job is still running


class SemanticSearch:
    def __init__(
        self,
        config: SemShareConfig,
        block_size: int,
        catalog: DonorCatalog,
        discovery: DiscoveryService,
        aligner: Aligner | None,
        stats: StatsRecorder,
    ):
        self.config = config
        self.block_size = block_size
        self.catalog = catalog
        self.discovery = discovery
        self.aligner = aligner
        self.stats = stats
        self.deadline_s = config.lookup_deadline_ms / 1e3
        if aligner is not None:
            # at normal priority: a niced thread starves while vLLM compiles and profiles at
            # start-up, and the first hit's alignment would then wait for the table to load
            discovery.run(aligner.warm)

    # ---- a request's search -------------------------------------------------------------------
    def start(self, request, state: RequestState) -> None:
        d = self.discovery
        if d.failed or request.num_prompt_tokens < self.config.min_reuse_tokens:
            return
        if not keyable(request) or not semantic_allowed(request):
            return
        if reuse_mode(request) in ("off", "exact"):
            return
        namespace = namespace_of(request)
        if not d.index.has_donors(namespace):
            return  # nothing to find: never make a request wait for an empty namespace
        tokens = reusable_prompt(request)
        if len(tokens) < self.config.min_reuse_tokens:
            return  # its reuse limit leaves too little to claim
        exact = self.catalog.index.longest_prefix(namespace, tokens)
        if exact is not None and exact.num_tokens >= claim_limit(request, self.block_size):
            return  # an exact donor already covers all we could claim: no search to pay for
        state.job = DiscoveryJob("lookup", d.lookup(namespace, tokens))
        self.stats.add("semantic_lookups")

    def _wait(self, job: DiscoveryJob, give_up: bool = False) -> bool | None:
        """True: wait for the job; False: it is done; None: it ran past its deadline (or is
        abandoned, ``give_up``) and is cancelled."""
        now = time.monotonic()
        if job.asked is None:
            job.asked = now
        if job.future.done():
            return False
        if not give_up and now < job.started + self.deadline_s:
            job.held = now
            return True
        job.cancel()
        return None

    def poll_lookup(self, request, state: RequestState, nothing_left: bool) -> bool:
        """True while the request should wait for its donor search."""
        job = state.job
        if job is None or job.kind != "lookup":
            return False
        waiting = self._wait(job, give_up=nothing_left)
        if waiting:
            return True
        if waiting is None:
            self.stats.add("lookup_timeouts" if not nothing_left else "lookups_skipped")
        else:
            self._take_lookup(request, state, job)
        state.job = None
        # Held back: from vLLM's first wish to schedule it to the last time we said "wait"; its
        # time in vLLM's queue before or after is not ours.
        if job.held is not None:
            self.stats.add("lookup_wait_ms", (job.held - job.asked) * 1e3)
        state.search_wait_ms += job.held_ms()
        return False

    def _take_lookup(self, request, state: RequestState, job: DiscoveryJob) -> None:
        future = job.future
        if future.cancelled() or future.exception() is not None:
            return  # counted by the service as a discovery fault
        lookup: Lookup = future.result()
        self.stats.add("embed_ms", lookup.embed_ms)
        if lookup.no_shared_grams:
            self.stats.add("lookups_without_shared_grams")
        if lookup.too_long_to_embed:
            self.stats.add("lookups_too_long_to_embed")
        valid = [  # re-check: the donor may have gone while we searched
            c
            for c in lookup.candidates
            if self._offerable(self.catalog.index.get(c.key), request, state)
        ]
        if valid:
            state.found = SemanticMatch(valid, lookup)
            self.stats.add("semantic_found")
        else:
            self.stats.add("semantic_misses")

    def plan(
        self,
        request,
        state: RequestState,
        num_computed: int,
        exact_claim: int,
        recompute_ready: bool,
    ) -> SemanticPlan | object | None:
        """A ``SemanticPlan`` for the request, ``WAIT`` while its alignment runs, or None."""
        mode = reuse_mode(request)
        if (
            (state.found is None and state.job is None and state.aligned is None)
            or self.aligner is None
            or not recompute_ready
            or mode in ("off", "exact")
            or not semantic_allowed(request)
        ):
            return None
        end = reusable_length(request) - 1  # vLLM computes the last token of it
        if end - num_computed <= max(exact_claim, self.config.min_reuse_tokens - 1):
            # Nothing to wait for: an alignment started for a larger claim is dropped (its
            # wait counted once); the donors found stay for a later ask (after a preemption).
            if state.job is not None and state.job.kind == "align":
                state.align_wait_ms += state.job.held_ms()
                state.drop_job()
            return None
        if state.aligned is None:
            waiting = self._align(request, state, num_computed)
            if waiting is not False:
                return waiting
        key, al = state.aligned
        if not self._offerable(self.catalog.index.get(key), request, state):
            state.aligned = None
            return None
        if (
            coverage(al, num_computed, end) < self.config.min_alignment_coverage
            and mode != "semantic"
        ):
            return None
        c = self.config
        return plan_claim(
            key,
            al,
            num_computed,
            end,
            c.recompute_run_head,
            c.recompute_tail,
            c.recompute_echo_span,
            c.recompute_echo_max_share,
        )

    def _offerable(self, record: DonorRecord | None, request, state: RequestState) -> bool:
        """The donor is still there, in the request's namespace, not demoted, and not withheld
        from its prompt (``DonorRecord.withheld``)."""
        return (
            record is not None
            and record.key.namespace == namespace_of(request)
            and not record.demoted
            and not record.withheld(*state.served_prompt(request))
        )

    def _align(self, request, state: RequestState, num_computed: int):
        """Start or poll the request's alignment: False once ``state.aligned`` is set, else
        ``WAIT`` or None (no alignment to use)."""
        if state.job is None:
            index = self.catalog.index
            # Aligned to each donor's prompt, as discovery found it and as its features were
            # prepared (``prepare_alignment``). A copy of the prompt may have escalated since
            # the search.
            donors = [
                (c.key, list(index.get(c.key).prompt_token_ids))
                for c in state.found.candidates
                if self._offerable(index.get(c.key), request, state)
            ]
            if not donors:
                return None
            target = reusable_prompt(request)
            aligner = self.aligner
            state.job = DiscoveryJob(
                "align", self.discovery.run(lambda: aligner.best(target, num_computed, donors))
            )
        job = state.job
        waiting = self._wait(job)
        if waiting:
            return WAIT
        state.job, state.found = None, None
        state.align_wait_ms += job.held_ms()
        if waiting is None:
            self.stats.add("align_timeouts")
            return None
        future = job.future
        if future.cancelled() or future.exception() is not None or future.result() is None:
            return None
        state.aligned = future.result()
        self.stats.add("align_ms", (time.monotonic() - job.started) * 1e3)
        return False

    # ---- donors -------------------------------------------------------------------------------
    def embed_donor(
        self, record: DonorRecord, then=None, *, holds_tokens: int = 0, on_drop=None
    ) -> None:
        """Embed the donor on the discovery thread (``then(embedded)`` runs there after; the
        discovery service's ``register`` says what ``holds_tokens`` and ``on_drop`` are)."""
        if record.serial and record.key in self.catalog.index:
            self.catalog.index.offer_content(record.key)  # findable by its text at once
            # Its alignment features first: a target found by its text meanwhile aligns to it,
            # and at 4K they take ~0.1 s against the embedding's seconds.
            self.prepare_alignment(record)
            self.discovery.register(
                record.key,
                record.serial,
                _prompt_of(record),
                then,
                holds_tokens=holds_tokens,
                on_drop=on_drop,
            )

    def prepare_alignment(self, record: DonorRecord) -> None:
        if self.aligner is not None:
            aligner, key, tokens_of = self.aligner, record.key, _prompt_of(record)

            def prepare() -> None:
                tokens = tokens_of()
                if tokens is not None:  # (None: the donor left the catalog meanwhile)
                    aligner.prepare(key, tokens)

            self.discovery.run_background(prepare)

    def absorb_embeddings(self) -> None:
        """Attach donors' embeddings computed on the discovery thread."""
        for e in self.discovery.take_embedded():
            if self.catalog.set_embedding(e.key, e.serial, e.embedding, e.fingerprint):
                self.stats.add("embed_ms", e.embed_ms)


def _prompt_of(record: DonorRecord):
    """The donor's prompt tokens when asked, None once the catalog let the record go: queued
    discovery work reads the catalog's tokens and keeps no copy of them alive."""
    ref = weakref.ref(record)

    def tokens() -> list[int] | None:
        alive = ref()
        return None if alive is None else alive.prompt_token_ids

    return tokens
