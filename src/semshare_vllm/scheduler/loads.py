"""From an offer vLLM allocated blocks for to the worker's ``LoadSpec``; and the blocks each
load wrote, until a failure of it can no longer be reported (``LoadWatch``)."""

from __future__ import annotations

from semshare_vllm.catalog.donor_index import PrefixMatch
from semshare_vllm.config import SemShareConfig
from semshare_vllm.core.counters import StatsRecorder
from semshare_vllm.layout.geometry import KVGeometry
from semshare_vllm.metadata import FailedLoad, LoadSpec
from semshare_vllm.scheduler.planner import SemanticPlan
from semshare_vllm.scheduler.request_state import RequestState
from semshare_vllm.vllm_compat import block_hashes as vllm_block_hashes
from semshare_vllm.vllm_compat.step_blocks import blocks_filled_in_step

# Outputs after a request finished during which a failure of its load may still come back
# (async scheduling has up to two steps in flight).
FAILURE_REPORT_OUTPUTS = 3
# Steps scheduled after a load's own within which the worker must have said it ran (at most
# two are in flight); past them its blocks leave vLLM's prefix cache instead of holding
# other requests back.
UNCONFIRMED_STEPS = 4


def load_spec(
    request,
    offer: PrefixMatch | SemanticPlan,
    block_ids: list[int],
    num_external_tokens: int,
    config: SemShareConfig,
    geometry: KVGeometry,
) -> LoadSpec:
    """What the worker loads for ``offer``, of which vLLM took ``num_external_tokens``."""
    if isinstance(offer, SemanticPlan):
        plan = (
            offer
            if num_external_tokens >= offer.num_tokens
            else offer.truncated(num_external_tokens)
        )  # vLLM took less than offered
        return LoadSpec(
            req_id=request.request_id,
            key=plan.key,
            src_start=0,
            dst_start=plan.start,
            num_tokens=plan.num_tokens,
            block_ids=block_ids,
            policy=config.recompute_policy,
            always=plan.always,
            token_ids=list(request.all_token_ids[: plan.end]),
            donor_pos=plan.donor_pos,
        )
    start = offer.num_tokens - num_external_tokens
    spec = LoadSpec(
        req_id=request.request_id,
        key=offer.key,
        src_start=start,
        dst_start=start,
        num_tokens=num_external_tokens,
        block_ids=block_ids,
    )
    if config.recompute_policy == "all" and not geometry.exact_only:  # (fp8: not repairable)
        spec.policy = "all"
        spec.token_ids = list(request.all_token_ids[: start + num_external_tokens])
    return spec


def failed_load(request, offer, block_ids: list[int], num_external_tokens: int) -> FailedLoad:
    """vLLM counts the claimed tokens as loaded, but the load could not be planned: its blocks
    are reported failed, from where the claim starts (vLLM sets num_computed_tokens only after
    allocating; unknown: every block of the request)."""
    if isinstance(offer, SemanticPlan):
        start = offer.start
    elif isinstance(offer, PrefixMatch):
        start = max(offer.num_tokens - num_external_tokens, 0)
    else:
        start, num_external_tokens = 0, request.num_tokens
    return FailedLoad(request.request_id, start, num_external_tokens, block_ids)


def hold_back_unwritten_prefix(
    loads: list[LoadSpec],
    failed: list[FailedLoad],
    scheduler_output,
    kv_cache_manager,
    block_size: int,
) -> tuple[list[LoadSpec], list[FailedLoad]]:
    """Split this step's loads into those to run and those to report failed: a repair attends
    over the request's prefix before the step's forward pass, so a load whose prefix (vLLM's own
    hit) holds a block that pass writes (another request computes it in this step), or that
    another load of this step writes or fails to (``failed``), is not run; vLLM computes its
    tokens in a later step, when the prefix exists. Loads without a repair only copy rows and
    read nothing of the prefix."""
    repaired = [s for s in loads if s.policy != "none" and s.dst_start >= block_size]
    if not repaired:
        return loads, []
    filled = blocks_filled_in_step(scheduler_output, kv_cache_manager, block_size)
    if filled is not None:
        for start, n, blocks in [(s.dst_start, s.num_tokens, s.block_ids) for s in loads] + [
            (f.start, f.num_tokens, f.block_ids) for f in failed
        ]:
            filled.update(blocks[start // block_size : -(-(start + n) // block_size)])
    held = [
        s
        for s in repaired
        if filled is None or not filled.isdisjoint(s.block_ids[: s.dst_start // block_size])
    ]
    return _report_failed(loads, held)


def hold_back_every_repair(loads: list[LoadSpec]) -> tuple[list[LoadSpec], list[FailedLoad]]:
    """Where the step's blocks cannot be told (a fault): every repaired load is reported failed,
    never a repair over KV not known to exist."""
    return _report_failed(loads, [s for s in loads if s.policy != "none"])


def _report_failed(
    loads: list[LoadSpec], held: list[LoadSpec]
) -> tuple[list[LoadSpec], list[FailedLoad]]:
    """``loads`` less ``held``, and ``held`` as failed loads: vLLM computes their tokens."""
    if not held:
        return loads, []
    kept = [s for s in loads if all(s is not h for h in held)]
    return kept, [FailedLoad(s.req_id, s.dst_start, s.num_tokens, s.block_ids) for s in held]


class LoadWatch:
    """A failed load leaves blocks vLLM's ``recompute`` policy keeps cached for the request to
    recompute; a request preempted or aborted first would leave never-written KV under its true
    hashes. The blocks of every load are watched here until no failure can come back for them."""

    def __init__(self, block_size: int, stats: StatsRecorder):
        self.block_size = block_size
        self.stats = stats
        # loads of requests that finished before their step's output came back: their failure
        # may still be reported (async scheduling) -> (blocks, outputs left to wait)
        self._finished: dict[str, tuple[list[int], int]] = {}
        # loads the worker has not yet said it ran: seq -> (block hashes, block ids, steps
        # scheduled since). vLLM cached their blocks at allocation; until their step's output
        # comes back (with a failure, if any) no other request may take them as its prefix.
        self._unconfirmed: dict[int, tuple[frozenset, list[int], int]] = {}
        self.kv_cache_manager = None  # vLLM's, for evicting failed blocks
        # requests whose failed load had marked their prompt-logprob rows: the worker forgets
        # those rows before vLLM computes the prompt again (``take_logprob_restarts``)
        self._logprob_restarts: list[str] = []

    def watch(self, state: RequestState, block_ids: list[int], start: int) -> None:
        """The request's blocks from the one holding ``start`` (the first a load writes) on."""
        state.loaded_blocks = block_ids[start // self.block_size :]

    def unconfirmed(self, seq: int, request, block_ids: list[int], start: int) -> None:
        """A load just allocated: its full blocks from the one holding ``start`` on (through
        every block the request has a hash for: a resumed request's claim may go past its
        prompt, and what vLLM computes after a load reads it) are unwritten until the worker
        says the load ran."""
        first = start // self.block_size
        hashes = frozenset(vllm_block_hashes.prefix_hashes(request, first, None))
        if hashes:
            self._unconfirmed[seq] = (hashes, block_ids[first : first + len(hashes)], 0)

    def behind_unconfirmed(self, request, num_computed_tokens: int) -> bool:
        """Whether vLLM's own prefix hit of ``request`` holds a block of a load the worker has
        not yet said it ran. With async scheduling the next step is scheduled before the
        load's output comes back: a request taking those blocks then would compute over KV a
        failed load never wrote, and vLLM would not rewind it."""
        if not self._unconfirmed or num_computed_tokens < self.block_size:
            return False
        hit = vllm_block_hashes.prefix_hashes(request, 0, num_computed_tokens // self.block_size)
        return any(not hashes.isdisjoint(hit) for hashes, _, _ in self._unconfirmed.values())

    def confirmed(self, seqs) -> None:
        """The worker ran these loads (a failure came in the same output, handled first)."""
        for seq in seqs:
            self._unconfirmed.pop(seq, None)

    def age_unconfirmed(self) -> None:
        """One more step scheduled. A load never confirmed (its report lost) holds no request
        back forever: its blocks leave vLLM's prefix cache instead, as a failed load's do."""
        for seq, (hashes, blocks, steps) in list(self._unconfirmed.items()):
            if steps + 1 < UNCONFIRMED_STEPS:
                self._unconfirmed[seq] = (hashes, blocks, steps + 1)
                continue
            del self._unconfirmed[seq]
            vllm_block_hashes.evict_cached(self.kv_cache_manager, blocks)
            self.stats.add("unconfirmed_loads_uncached")

    def finished(self, state: RequestState) -> None:
        if state.loaded_blocks is not None:
            self._finished[state.req_id] = (state.loaded_blocks, FAILURE_REPORT_OUTPUTS)

    def finished_watched(self) -> list[str]:
        """Finished requests whose load's failure may still be reported."""
        return list(self._finished)

    def on_output(self, invalid: set[int] | None, live: dict[str, RequestState]) -> None:
        """One engine output: take failed blocks (and every block computed after them from that
        KV) out of vLLM's prefix cache, mark live requests never to be captured, and age the
        finished loads."""
        if invalid:
            self._uncache_failed(invalid, live)
        for req_id, (blocks, left) in list(self._finished.items()):
            if left <= 1:
                del self._finished[req_id]
            else:
                self._finished[req_id] = (blocks, left - 1)

    def take_logprob_restarts(self) -> list[str]:
        """For the next step's metadata: it is built after the output that reported the
        failure (so after the failed step's forward) and runs before vLLM's recompute."""
        taken, self._logprob_restarts = self._logprob_restarts, []
        return taken

    def _uncache_failed(self, invalid: set[int], live: dict[str, RequestState]) -> None:
        watched = [(s, s.loaded_blocks) for s in live.values() if s.loaded_blocks is not None]
        watched += [(None, blocks) for blocks, _ in self._finished.values()]
        for state, blocks in watched:
            bad = next((i for i, b in enumerate(blocks) if b in invalid), None)
            if bad is None:
                continue
            if state is not None:  # (a finished one is past capturing)
                state.load_failed = True
                if state.marks_logprobs:
                    state.marks_logprobs = False
                    self._logprob_restarts.append(state.req_id)
            vllm_block_hashes.evict_cached(self.kv_cache_manager, blocks[bad:])
            self.stats.add("failed_blocks_uncached", len(blocks) - bad)
