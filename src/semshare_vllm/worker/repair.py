"""The selective recompute after a load (``recompute_policy``): the loaded tokens run again
through the model's own layers, as many as the policy picks, so that approximate KV is never
used as it was loaded.

Unrepaired or half-repaired KV must not be used: whenever the repair cannot run or fails, the
loaded range is reported failed (by the caller, once the tensor-parallel ranks agree:
``loads.py``) and vLLM computes those tokens.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from semshare_vllm.config import SemShareConfig
from semshare_vllm.core.counters import StatsRecorder
from semshare_vllm.kernels import RopeTable
from semshare_vllm.layout.specs import PageOffsets
from semshare_vllm.logs import warn_once
from semshare_vllm.metadata import LoadSpec, RepairReport
from semshare_vllm.recompute.layer_runner import LayerRunner
from semshare_vllm.recompute.policy import Selection, make_selection

logger = logging.getLogger("vllm.semshare.worker")


@dataclass
class Repairer:
    """What repairs a load on this worker (built once, ``setup.make_repairer``)."""

    runner: LayerRunner  # the model's layers over vLLM's paged caches
    # Semantic loads move donor rows to other positions: K is re-rotated with the model's own
    # RoPE, through one address scheme for this engine's pages.
    rope: RopeTable
    offsets: PageOffsets
    # Reports the measured deviation and the repair's figures (``RepairReport``) to the
    # scheduler: every tensor-parallel rank measures and recomputes the same (scores summed
    # over the ranks), and vLLM concatenates the ranks' reports, so one rank does.
    reports_deviation: bool = True


def plan_repair(
    repairer: Repairer | None, spec: LoadSpec, config: SemShareConfig, stats: StatsRecorder
) -> Selection | None:
    """The policy's selection over ``spec``'s loaded range, or None where this worker cannot
    repair it. Everything that can fail before the recompute's first collective happens here,
    so that the tensor-parallel ranks agree on it before any of them starts (``loads.py``)."""
    if repairer is None:
        stats.add("recompute_unavailable_tokens", spec.num_tokens)
        return None
    try:
        return make_selection(
            spec.policy,
            np.arange(spec.dst_start, spec.dst_start + spec.num_tokens),
            np.asarray(spec.always, dtype=np.int64),
            config,
            len(repairer.runner.layers),
        )
    except Exception as exc:
        _failed(spec, exc, stats)
        return None


def repair(
    repairer: Repairer,
    spec: LoadSpec,
    selection: Selection,
    stats: StatsRecorder,
    donor_kv_ready: tuple[int, Callable[[], bool]] | None = None,
) -> RepairReport | None:
    """Recompute what ``selection`` picks of the loaded range, in place in its blocks: what it
    did, or None where it failed (the loaded range must then be reported failed, as where the
    selection declined: ``RepairReport.declined``). The caller reports the figures once every
    rank's repair succeeded or declined (``WorkerReport.repaired``). ``donor_kv_ready``: the
    layer runner's, where the donor KV is still being moved (``LayerRunner.recompute``)."""
    t0, waited = time.perf_counter(), 0.0
    if donor_kv_ready is not None:  # its wait is the load's part of the time, not the recompute's
        layer, ready = donor_kv_ready

        def timed_ready() -> bool:
            nonlocal waited
            began = time.perf_counter()
            try:
                return ready()
            finally:
                waited += time.perf_counter() - began

        donor_kv_ready = (layer, timed_ready)
    try:
        result = repairer.runner.recompute(
            spec.token_ids,
            spec.block_ids,
            selection,
            context=spec.dst_start + spec.num_tokens,
            donor_kv_ready=donor_kv_ready,
        )
    except Exception as exc:
        _failed(spec, exc, stats)
        return None
    if result.stopped:  # the move failed (counted and logged where it did), here or elsewhere
        return None
    if spec.donor_pos is not None and selection.measured is not None:
        stats.add("deviation_sum", selection.measured)
        stats.add("deviation_count")
    gate = selection.gate_residual
    if gate is not None:
        stats.add("recompute_gate_checks")
    if selection.escalations:
        stats.add("recompute_escalated_loads")
        stats.add("recompute_escalations", selection.escalations)
    if selection.declined:
        stats.add("recompute_declined")
    stats.add("recomputed_tokens", max(result.per_layer, default=0))
    stats.add("recomputed_token_layers", sum(result.per_layer))
    recompute_ms = (time.perf_counter() - t0 - waited) * 1e3
    stats.add("recompute_ms", recompute_ms)
    # one count per layer of the model (an empty selection: none, nothing redone); an
    # escalation's second pass through some layers counts there too
    work = len(result.per_layer) * spec.num_tokens
    return RepairReport(
        spec.req_id,
        spec.seq,
        sum(result.per_layer) / work if work else 0.0,
        selection.measured,
        selection.residual,
        gate,
        selection.escalations,
        selection.declined,
        recompute_ms=recompute_ms,
        recompute_layer_ms=result.per_layer_ms,
        recompute_whole_ms=result.whole_layers_ms,
    )


def _failed(spec: LoadSpec, exc: Exception, stats: StatsRecorder) -> None:
    warn_once(
        logger,
        "recompute",
        "SemShare: recompute for request %s failed (%s); its loaded tokens are computed by vLLM",
        spec.req_id,
        exc,
    )
    stats.add("recompute_failures")
