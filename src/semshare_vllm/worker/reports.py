"""What the worker tells vLLM and the scheduler, gathered between two steps.

vLLM asks for each part through its own callback (``get_finished``,
``get_block_ids_with_load_errors``, ``build_connector_worker_meta``); each ``take_*`` hands over
what was gathered and starts afresh, so nothing is reported twice.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Iterable

from semshare_vllm.core.keys import DonorKey
from semshare_vllm.metadata import LoadSpec, RepairReport, SemShareWorkerMetadata

# Steps whose failed blocks a repair still checks its prefix against: async scheduling has two
# in flight, so a step is scheduled at most one step before vLLM has the last one's failures.
RECENT_STEPS = 2


@dataclass
class WorkerReport:
    block_size: int
    # captured (or refused) requests whose blocks vLLM may now free
    finished_sending: set[str] = field(default_factory=set)
    # blocks whose load failed: vLLM recomputes their tokens
    invalid_blocks: set[int] = field(default_factory=set)
    # those of the last steps, taken by vLLM: with async scheduling the next step is scheduled
    # before vLLM has them, and may take them as a request's own prefix hit
    recent_invalid: collections.deque = field(
        default_factory=lambda: collections.deque(maxlen=RECENT_STEPS)
    )
    # requests whose load failed, until vLLM says they finished: never captured (their blocks
    # may hold KV nobody wrote, if they end before vLLM recomputes it)
    failed_loads: set[str] = field(default_factory=set)
    # for the scheduler (SemShareWorkerMetadata)
    bad_donors: list[DonorKey] = field(default_factory=list)
    deviations: list[tuple[DonorKey, float]] = field(default_factory=list)  # per semantic load
    repairs: list[RepairReport] = field(default_factory=list)  # per repaired load
    capacity: int | None = None  # once, after register_kv_caches
    recompute_ready: bool | None = None  # once, with the capacity
    disabled: str | None = None  # once, when this worker turned itself off
    loads_done: list[int] = field(default_factory=list)  # seq of each load this step ran
    weights_changed: bool = False  # once, after a weight update: the scheduler resets

    def fail_load(self, req_id: str, block_ids: list[int], start: int, num_tokens: int) -> None:
        """Report the blocks of positions ``[start, start + num_tokens)`` failed."""
        first, last = start // self.block_size, (start + num_tokens - 1) // self.block_size
        self.invalid_blocks.update(block_ids[first : last + 1])
        self.failed_loads.add(req_id)

    def repaired(self, spec: LoadSpec, figures: RepairReport) -> None:
        """A load whose repair succeeded on every rank: its figures for the request's
        provenance, and a semantic donor's measured deviation for the divergence eviction."""
        self.repairs.append(figures)
        if figures.declined:
            return  # a declined load's KV is not served: no deviation of a reuse to report
        if spec.donor_pos is not None and figures.deviation_before is not None:
            self.deviations.append((spec.key, figures.deviation_before))

    def take_finished(self, finished_req_ids: Iterable[str]) -> set[str] | None:
        self.failed_loads.difference_update(finished_req_ids)
        done, self.finished_sending = self.finished_sending, set()
        return done or None

    def take_invalid_blocks(self) -> set[int]:
        bad, self.invalid_blocks = self.invalid_blocks, set()
        self.recent_invalid.append(bad)
        return bad

    def unwritten(self, block_ids: Iterable[int]) -> bool:
        """Whether a load failed to write any of ``block_ids`` in this step or the last
        ``RECENT_STEPS`` (vLLM may not have had the failure when it scheduled this step)."""
        return any(
            b in self.invalid_blocks or any(b in taken for taken in self.recent_invalid)
            for b in block_ids
        )

    def take_worker_meta(self) -> SemShareWorkerMetadata | None:
        if (
            not self.bad_donors
            and self.capacity is None
            and not self.deviations
            and not self.repairs
            and self.disabled is None
            and not self.loads_done
            and not self.weights_changed
        ):
            return None
        meta = SemShareWorkerMetadata(
            self.bad_donors,
            self.capacity,
            self.recompute_ready,
            self.deviations,
            self.disabled,
            self.repairs,
            self.loads_done,
            self.weights_changed,
        )
        self.bad_donors, self.capacity, self.recompute_ready = [], None, None
        self.deviations, self.disabled, self.repairs = [], None, []
        self.loads_done, self.weights_changed = [], False
        return meta
