"""Typed messages between the scheduler half and the worker half.

Scheduler -> worker: ``SemShareConnectorMetadata`` (built once per step; pickled to worker
processes, so plain lists only). Worker -> scheduler: ``SemShareWorkerMetadata`` (through vLLM's
``build_connector_worker_meta`` back-channel), and once at start-up ``SemShareHandshake``
(vLLM's connector handshake). The donor key they carry is
``core.keys.DonorKey``, which the catalog and the stores use without vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from semshare_vllm.core.keys import DonorKey


@dataclass
class CaptureSpec:
    """Copy ``num_tokens`` tokens of a finished request out of its blocks into the host store."""

    req_id: str
    key: DonorKey
    token_ids: list[int]
    block_ids: list[int]
    # how many of token_ids were the request's prompt (None: all): kept with a persisted donor
    num_prompt_tokens: int | None = None


@dataclass
class LoadSpec:
    """Write donor tokens ``[src_start, src_start + num_tokens)`` into the request's token
    positions ``[dst_start, dst_start + num_tokens)``; ``block_ids`` are the request's blocks
    (all of them, indexed by position // block_size)."""

    req_id: str
    key: DonorKey
    src_start: int
    dst_start: int
    num_tokens: int
    block_ids: list[int]
    # This load's number (the scheduler's, unique in the process): the worker's figures of it
    # (``RepairReport``) are matched to it, never to another load of the same request.
    seq: int = 0
    # Repair after the copy (``recompute_policy``): "none" (the KV is exact), else the policy
    # the worker runs over the loaded range, the positions it must always recompute, and the
    # request's token ids from position 0 to the end of the loaded range.
    policy: str = "none"
    always: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    # Semantic loads: the donor position of each loaded position (-1: none), in place of the
    # contiguous copy from ``src_start``. K is RoPE-corrected from donor to target positions.
    donor_pos: list[int] | None = None
    # A request asking for prompt logprobs (``semshare_reuse_limit``): the worker marks the rows
    # of positions [0, mark_logprobs_until) as served, not computed (``prompt_logprobs``).
    mark_logprobs_until: int = 0
    # With an LMCache tier (``kv_tier``): the donor's own token ids, its key there, for a donor
    # that is not (or no longer) in this worker's host store.
    donor_token_ids: list[int] | None = None
    # Another instance's donor (shared index): per tensor-parallel rank, the digest of the KV
    # shard it put (``catalog.shared_records.kv_digest``, signed by that rank); a fetch from the
    # tier that does not match this worker's rank's digest is refused (the load fails, vLLM
    # computes).
    donor_kv_digests: list[str] | None = None


@dataclass
class FailedLoad:
    """vLLM took a claim the scheduler then could not plan (a fault after the match): nothing is
    loaded, and the blocks of positions ``[start, start + num_tokens)`` are reported failed, so
    that vLLM computes them."""

    req_id: str
    start: int
    num_tokens: int
    block_ids: list[int]


@dataclass
class RepairReport:
    """What one repaired load's recompute did, for its request's provenance
    (``scheduler/provenance.py``)."""

    req_id: str
    seq: int  # the load's ``LoadSpec.seq``
    # recomputed token-layers / (loaded tokens x layers): 1.0 when every loaded token was
    # recomputed in every layer (policy "all")
    recompute_share: float
    # the selection's ``measured`` and ``residual`` (None where the policy measured nothing)
    deviation_before: float | None = None
    deviation_after: float | None = None
    # the adaptive policy's gate: the error it estimated left at the gate layer (None: no gate
    # ran), and how many times it widened the recompute because that was above the bound
    gate_residual: float | None = None
    escalations: int = 0
    # the gate declined the load (``recompute_decline_share``): it is reported failed, and vLLM
    # computes its tokens; these figures still say why (and count towards demoting the donor)
    declined: bool = False
    # this worker's time on the load (ms): moving the donor KV into the request's blocks, and
    # the recompute (the hit's time breakdown in its provenance)
    load_ms: float | None = None
    recompute_ms: float | None = None
    # the recompute's time per layer of the model, and the part of it spent in the layers that
    # ran every position it started with (layer 0, the check layer's probe)
    recompute_layer_ms: list[float] | None = None
    recompute_whole_ms: float | None = None


@dataclass
class SemShareConnectorMetadata(KVConnectorMetadata):
    # Order matters: the worker drops evictions, then captures, then loads, so a donor captured
    # this step can already serve a load in the same step.
    evictions: list[DonorKey] = field(default_factory=list)
    captures: list[CaptureSpec] = field(default_factory=list)
    loads: list[LoadSpec] = field(default_factory=list)
    failed_loads: list[FailedLoad] = field(default_factory=list)
    # Requests whose load marked their prompt-logprob rows and then failed: vLLM computes their
    # prompt again from position 0, so the rows the runner holds are forgotten before that
    # step's forward (``vllm_compat.prompt_logprobs.restart_rows``).
    restart_logprob_rows: list[str] = field(default_factory=list)
    # vLLM reset the connector (``reset_prefix_cache(reset_connector=True)``: its pause and
    # sleep, around weight updates), or the worker reported the weights updated: the worker
    # drops every donor it holds (the step's evictions, every donor the scheduler knew, with
    # their files) and every capture in flight, frees the blocks of this step's captures
    # without keeping them (their KV was computed before the reset), and persists and shares
    # nothing from then on.
    reset: bool = False
    # vLLM got back the blocks it held for captures (``vllm_compat.prefix_cache_reset``): the
    # worker copies every capture, this step's and those in flight, before the step writes
    # anything (its loads, its forward) into blocks that may now be another request's.
    captures_released: bool = False


@dataclass
class SemShareWorkerMetadata(KVConnectorWorkerMetadata):
    """Donors the worker found unusable (missing, corrupt), which the scheduler forgets; once,
    the bytes the worker's host pool really holds, which caps the scheduler's accounting; and
    what each repaired load measured."""

    bad_donors: list[DonorKey] = field(default_factory=list)
    capacity_bytes: int | None = None
    # once, with the capacity: whether this worker can repair approximate KV (layer runner)
    recompute_ready: bool | None = None
    # (donor, measured deviation) of each semantic load repaired this step
    deviations: list[tuple[DonorKey, float]] = field(default_factory=list)
    # once: the worker turned itself off (the reason): the scheduler stops claiming and
    # capturing. Any rank off turns them all off.
    disabled: str | None = None
    # each load repaired this step (one rank reports them, as the deviations)
    repairs: list[RepairReport] = field(default_factory=list)
    # ``LoadSpec.seq`` of every load this step ran, whatever came of it (a failure is in the
    # same output's invalid blocks): until then its blocks are no other request's prefix hit
    loads_done: list[int] = field(default_factory=list)
    # the model's weights were updated in place: every donor of before must be forgotten (the
    # worker dropped its copies) and a reset sent back. Any rank's report is every rank's.
    weights_changed: bool = False

    def aggregate(self, other: "KVConnectorWorkerMetadata") -> "KVConnectorWorkerMetadata":
        assert isinstance(other, SemShareWorkerMetadata)
        merged = list(self.bad_donors)
        merged.extend(k for k in other.bad_donors if k not in merged)
        caps = [c for c in (self.capacity_bytes, other.capacity_bytes) if c is not None]
        ready = [r for r in (self.recompute_ready, other.recompute_ready) if r is not None]
        return SemShareWorkerMetadata(
            merged,
            min(caps) if caps else None,
            all(ready) if ready else None,
            self.deviations + other.deviations,
            self.disabled or other.disabled,
            self.repairs + other.repairs,
            sorted(set(self.loads_done) | set(other.loads_done)),
            self.weights_changed or other.weights_changed,
        )


@dataclass
class SemShareHandshake(KVConnectorHandshakeMetadata):
    """Worker -> scheduler once, at start-up before any request (vLLM collects it from every
    worker after the KV cache is registered): the fingerprint this worker files its donors
    under, of what it loaded (``layout/geometry.py``), and why its donors stay in its process
    (``KVGeometry.local_only``), if they do."""

    fingerprint: str
    local_only: str | None = None
