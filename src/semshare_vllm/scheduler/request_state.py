"""Everything the scheduler half knows about one live request, in one object: created when the
request is first seen, dropped (one ``pop``) when vLLM says it finished."""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import NamedTuple

from semshare_vllm.alignment import Alignment
from semshare_vllm.catalog.donor_index import PrefixMatch
from semshare_vllm.core.keys import DonorKey
from semshare_vllm.discovery.service import Lookup
from semshare_vllm.discovery.vector_index import Candidate
from semshare_vllm.metadata import RepairReport
from semshare_vllm.scheduler.planner import SemanticPlan
from semshare_vllm.scheduler.request_params import reusable_prompt, wants_prompt_logprobs


@dataclass
class DiscoveryJob:
    """A donor search or an alignment running on the discovery thread for the request; vLLM
    re-asks each step, and the request waits for the job until its deadline."""

    kind: str  # "lookup" or "align"
    future: Future
    started: float = field(default_factory=time.monotonic)
    asked: float | None = None  # when vLLM first wanted to schedule the request
    held: float | None = None  # when we last told it to wait

    def cancel(self) -> None:
        self.future.cancel()

    def held_ms(self) -> float:
        """How long the request waited for this job, now that it goes on: from vLLM's first
        wish to schedule it until now (0 where it never had to wait)."""
        return 0.0 if self.held is None else (time.monotonic() - self.asked) * 1e3


class ServedPrompt(NamedTuple):
    """Which prompt a load into a request serves: a donor whose load into that prompt needed
    more than its repair is withheld from it (``DonorRecord.withheld_from``)."""

    digest: int  # a hash of ``reusable_prompt``
    # the request scores a continuation of that prompt (prompt logprobs past its reuse limit,
    # semshare-bench's scoring request): it measures what served the prompt
    # (``DonorRecord.withheld``)
    scoring: bool


@dataclass
class SemanticMatch:
    """Donors discovery found for a request (valid when found: present, same namespace, not
    demoted, not withheld from its prompt), best first, and the request's own embedding."""

    candidates: list[Candidate]
    lookup: Lookup


@dataclass
class Served:
    """What served the request's prompt at its latest admission (vLLM admits it again after a
    preemption): its provenance, reported when it finishes (``provenance.py``)."""

    kind: str = "none"  # "exact" (a donor's exact prefix), "semantic" (an aligned donor)
    tokens: int = 0  # the claim vLLM took: positions loaded from the donor
    donor: DonorKey | None = None
    policy: str = "none"  # the repair the load asked for ("none": its KV is exact)
    seq: int | None = None  # the load's LoadSpec.seq
    repair: RepairReport | None = None  # the worker's figures of that load, once reported
    vllm_cached_tokens: int | None = None  # vLLM's own prefix-cache hit (None: not known)
    # which prompt the load served (``ServedPrompt.digest``): a donor whose load into it
    # escalated or was declined is withheld from it (``DonorCatalog.report_escalation``)
    target: int | None = None


@dataclass
class RequestState:
    req_id: str
    counted: bool = False  # its lookup is in the stats (vLLM re-asks)
    job: DiscoveryJob | None = None  # search or alignment in flight
    found: SemanticMatch | None = None  # donors its search found
    aligned: tuple[DonorKey, Alignment] | None = None  # the donor its alignment chose
    # offered this step (an exact prefix or a semantic plan), until vLLM allocates for it
    offer: PrefixMatch | SemanticPlan | None = None
    scoring: object | None = None  # the request, let past skip_reading_prefix_cache
    approximate: bool = False  # served from a semantic donor: never a donor
    # its blocks from the first one a load writes (a failed load's blocks, and those computed
    # after them, leave vLLM's prefix cache)
    loaded_blocks: list[int] | None = None
    load_failed: bool = False  # never captured as a donor
    # its load marks its prompt-logprob rows (``semshare_reuse_limit``): if the load fails, the
    # worker must forget them before vLLM recomputes the prompt
    marks_logprobs: bool = False
    local_hit: int | None = None  # vLLM's own prefix-cache hit it last asked us from
    served: Served = field(default_factory=Served)
    # Its time held back (not scheduled) by us, ms: waiting for its donor search, and for its
    # alignment (the scheduler's part of its time breakdown: ``provenance.py``)
    search_wait_ms: float = 0.0
    align_wait_ms: float = 0.0
    # the connector resets before it arrived: live at a later one, it is no donor
    epoch: int = 0
    _served_prompt: ServedPrompt | None = field(default=None, repr=False)

    def served_prompt(self, request) -> ServedPrompt:
        """The request's ``ServedPrompt``, hashed once (its prompt and parameters are fixed)."""
        if self._served_prompt is None:
            prompt = reusable_prompt(request)
            scoring = wants_prompt_logprobs(request) and len(prompt) < request.num_prompt_tokens
            self._served_prompt = ServedPrompt(hash(tuple(prompt)), scoring)
        return self._served_prompt

    def drop_job(self) -> None:
        if self.job is not None:
            self.job.cancel()
            self.job = None
