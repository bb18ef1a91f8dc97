"""A request's provenance: what served its prompt, returned to the client in the response's
``kv_transfer_params`` under one key (``KEY``), and observed in the connector's histograms from
the very same figures.

vLLM puts the dict ``request_finished`` returns into the request's final ``EngineCoreOutput``
(``Scheduler.update_from_output`` -> ``_free_request`` -> ``_connector_finished``); the output
processor copies it into the ``RequestOutput``, and the OpenAI server returns it as the response
body's ``kv_transfer_params`` (0.32: non-streaming responses only; 0.33: also the last streamed
chunk). Everything here sits under one key, so that neither vLLM (which reads
``do_remote_prefill`` there) nor another connector mistakes it for its own.

Order. In ``update_from_output`` (0.32 and 0.33 alike) vLLM calls ``request_finished`` in its
loop over the step's requests, and ``update_connector_output``, with the worker's report of the
same step, only after that loop. A request that finishes in the step that loaded it (max_tokens
1) is therefore finished before the worker's figures of its repair are known. Its dict is held
open: vLLM holds this very dict in that step's ``EngineCoreOutput``, which leaves the engine
only once ``update_from_output`` has returned, so the figures are written into it when the report
comes in the same call. ``settle`` closes every dict still open (their worker figures stay null,
``"repair_report": "missing"``): vLLM asks the scheduler half for its stats once per
``update_from_output``, after ``update_connector_output``, and the scheduler settles there (and,
as a backstop, when it builds the next step's metadata). No dict is written after it is
settled. A report is matched to the load it describes by the load's number (``LoadSpec.seq``),
so no figure ever comes from another load or another request.

The donor is named by an opaque reference: an HMAC of its key (namespace and id) under a secret
of this process (derived from ``shared_index_secret`` where set, so that instances sharing
donors name them alike). It is stable while the process lives, says nothing of the donor's text,
and differs between identities for the same text, so no tenant can correlate its references with
another's prompts (donors never serve another identity anyway).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from semshare_vllm.core.counters import StatsRecorder
from semshare_vllm.core.keys import DonorKey
from semshare_vllm.metadata import RepairReport
from semshare_vllm.scheduler.request_state import RequestState, Served

KEY = "semshare_provenance"
VERSION = 1


class Provenance:
    """The scheduler's provenance book: one dict per finished request (``finished``), the
    worker's figures written in while vLLM still holds it unsent (``repaired``), closed when the
    output is done (``settle``)."""

    def __init__(self, stats: StatsRecorder, secret: str | None = None):
        self.stats = stats
        self._secret = (
            hmac.new(secret.encode(), b"semshare provenance donor reference", "sha256").digest()
            if secret
            else secrets.token_bytes(32)
        )
        # finished this output, the worker's figures still due: (request, its state, the dict
        # vLLM holds)
        self._open: dict[str, tuple[object, RequestState, dict]] = {}

    def finished(self, request, state: RequestState) -> dict:
        """The ``kv_transfer_params`` for a request vLLM says finished (``state`` popped)."""
        params = {KEY: self._figures(request, state)}
        if params[KEY]["repair_report"] == "missing":
            self._open[state.req_id] = (request, state, params)
        else:
            self._observe(params[KEY])
        return params

    def repaired(self, report: RepairReport, live: dict[str, RequestState]) -> Served | None:
        """The worker's figures of one repaired load: kept for a live request, written into the
        dict of one that finished in this output. What that load served (its donor, its
        target; None: no request is known to have made it)."""
        state = live.get(report.req_id)
        if state is not None:
            if state.served.seq != report.seq:
                return None
            state.served.repair = report
            return state.served
        held = self._open.get(report.req_id)
        if held is None or held[1].served.seq != report.seq:
            return None  # finished earlier (settled), or aborted: nobody reads it
        request, state, params = self._open.pop(report.req_id)
        state.served.repair = report
        params[KEY] = self._figures(request, state)
        self._observe(params[KEY])
        return state.served

    def settle(self) -> None:
        """vLLM's output is done: dicts still open keep their worker figures null."""
        for _, _, params in self._open.values():
            self._observe(params[KEY])
        self._open.clear()

    # ---- the figures ---------------------------------------------------------------------------
    def _figures(self, request, state: RequestState) -> dict:
        served = state.served
        kind = served.kind
        share, status, before, after, gate, escalations = None, None, None, None, None, 0
        declined = served.repair is not None and served.repair.declined
        if declined:  # the gate declined it: vLLM computed the prompt; say why
            gate, escalations = served.repair.gate_residual, served.repair.escalations
        if kind != "none" and not state.load_failed:
            if served.policy == "none":
                share = 0.0  # exact KV, used as loaded
            elif served.repair is not None:
                share, status = served.repair.recompute_share, "received"
                before, after = served.repair.deviation_before, served.repair.deviation_after
                gate, escalations = served.repair.gate_residual, served.repair.escalations
            else:
                status = "missing"  # not (yet) reported
        return {
            "version": VERSION,
            "served": kind,
            "prompt_tokens": int(request.num_prompt_tokens),
            "vllm_cached_tokens": served.vllm_cached_tokens,
            "exact_tokens": served.tokens if kind == "exact" else 0,
            "semantic_tokens": served.tokens if kind == "semantic" else 0,
            "donor": None if served.donor is None else self._reference(served.donor),
            "recompute_policy": served.policy,
            "recompute_share": _rounded(share),
            "deviation_before": _rounded(before),
            "deviation_after": _rounded(after),
            "gate_residual": _rounded(gate),
            "repair_report": status,
            "load_failed": state.load_failed,
            "preemptions": int(getattr(request, "num_preemptions", 0) or 0),
            "escalations": int(escalations),
            "declined": declined,
            "timings_ms": _timings(state),
            "recompute_layers_ms": _per_layer(state),
            "recompute_whole_ms": _rounded(
                None if served.repair is None else served.repair.recompute_whole_ms, 1
            ),
        }

    def _reference(self, key: DonorKey) -> str:
        message = key.namespace.encode() + b"\0" + key.donor_id.encode()
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()[:32]

    def _observe(self, figures: dict) -> None:
        # which histograms see it: a hit's, or, apart from them, what a declined load or a miss
        # cost (a miss: its waits for a donor); a load that failed otherwise, none
        timings, parts = figures["timings_ms"], figures["timings_ms"].keys()
        if figures["declined"]:
            side = "declined"
        elif figures["served"] == "none":
            side, parts = "missed", ("search", "align")
        elif figures["load_failed"]:
            return
        else:
            side = "served"
        for name in parts:
            if timings[name] is not None:
                self.stats.observe(f"{side}_{name}_ms", timings[name])
        if side != "served":
            return
        if figures["recompute_share"] is not None:
            self.stats.observe("served_recompute_share", figures["recompute_share"])
        for name in ("deviation_before", "deviation_after", "gate_residual"):
            if figures[name] is not None:
                self.stats.observe(f"served_{name}", figures[name])
        if figures["recompute_whole_ms"] is not None:
            self.stats.observe("served_recompute_whole_ms", figures["recompute_whole_ms"])
        if figures["recompute_layers_ms"] is not None:
            self.stats.observe_layers("served_recompute_layer_ms", figures["recompute_layers_ms"])


def _timings(state: RequestState) -> dict:
    """Where the request's time went, in ms, in parts that do not overlap: held back (not
    scheduled) waiting for its donor search (``search``) and for its alignment (``align``),
    and on the worker (the rank that reports) moving the donor KV (``load``) and recomputing
    (``recompute``; both None where no repaired load reported them). What its TTFT holds
    besides is vLLM's own: scheduling, the forward of the tokens it computes, the first
    sample."""
    repair = state.served.repair
    return {
        "search": _rounded(state.search_wait_ms, 1),
        "align": _rounded(state.align_wait_ms, 1),
        "load": _rounded(None if repair is None else repair.load_ms, 1),
        "recompute": _rounded(None if repair is None else repair.recompute_ms, 1),
    }


def _per_layer(state: RequestState) -> list[float] | None:
    """The recompute's time per layer of the model (ms; where it escalated, a layer it ran
    twice holds both runs), None where no repaired load reported it."""
    repair = state.served.repair
    if repair is None or repair.recompute_layer_ms is None:
        return None
    return [_rounded(ms, 1) for ms in repair.recompute_layer_ms]


def _rounded(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(float(value), digits)
