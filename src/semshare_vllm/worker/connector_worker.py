"""The worker half (each worker process): the callbacks vLLM makes, each delegating to one part.

Per step, in ``start_load_kv``: drop evicted donors, take new captures (``capture.py``), then
load claimed tokens into the requests' fresh blocks (``loads.py``, repaired by ``repair.py``),
and report the claims the scheduler could not plan as failed. After the forward pass
(``start_captures``, from ``wait_for_save``) the captures start in the background. What goes
back to vLLM and the scheduler is gathered in one ``WorkerReport`` (``reports.py``).

Nothing here may fail a request: expected failures (a donor missing, the pool full) are handled
where they happen; any other fault is stopped at the callback (``logs.guarded``), and a load it
interrupts is reported failed, so that vLLM computes those tokens.
"""

from __future__ import annotations

import logging

import torch

from semshare_vllm.config import SemShareConfig
from semshare_vllm.core.counters import StatsRecorder
from semshare_vllm.core.keys import DonorKey
from semshare_vllm.layout.geometry import KVGeometry
from semshare_vllm.logs import guarded
from semshare_vllm.metadata import (
    CaptureSpec,
    LoadSpec,
    SemShareConnectorMetadata,
    SemShareWorkerMetadata,
)
from semshare_vllm.vllm_compat import model_hook, weight_updates
from semshare_vllm.worker import setup
from semshare_vllm.worker.capture import Captures
from semshare_vllm.worker.loads import Loads
from semshare_vllm.worker.reports import WorkerReport
from semshare_vllm.worker.setup import WorkerKV

logger = logging.getLogger("vllm.semshare.worker")


class SemShareWorker:
    logger = logger  # for logs.guarded

    def __init__(self, config: SemShareConfig, geometry: KVGeometry, vllm_config):
        self.config = config
        self.geometry = geometry
        self._vllm_config = vllm_config
        self.stats = StatsRecorder()
        self.report = WorkerReport(geometry.block_size)
        self.disabled: str | None = geometry.unsupported
        self.kv: WorkerKV | None = None  # what register_kv_caches built
        self._closed = False
        # Where vLLM did not load our plugin (a VLLM_PLUGINS allowlist), the hooks go in now:
        # too late to see the model load, not to see the weight-update calls.
        model_hook.install()
        weight_updates.install()
        if not self.disabled and not model_hook.seen_any():
            logger.warning(
                "SemShare: no model load was seen on this worker (is the semshare plugin in "
                "VLLM_PLUGINS?): weight updates through the model's load_weights (TRL, "
                "OpenRLHF, verl) go unseen, so reset the connector after one "
                "(reset_prefix_cache(reset_connector=True)); vLLM's reload_weights and "
                "weight-transfer calls are seen"
            )
        # the weight updates seen (the model is loaded before the connector is made); after
        # one, the captures scheduled before the scheduler heard of it are refused
        self._weights = weight_updates.generation()
        self._awaiting_reset = False
        self._assemble()

    def _assemble(self) -> None:
        """The parts over ``self.kv`` (None: they refuse every capture and load)."""
        off = self.disabled or "no host store"
        self.captures = Captures(self.kv, off, self.stats, self.report)
        self.loads = Loads(
            self.kv, off, self.captures, self.config, self._vllm_config, self.stats, self.report
        )

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self.disabled:
            return
        try:
            self.kv = setup.build(
                kv_caches, self.config, self.geometry, self._vllm_config, self.stats
            )
        except Exception as exc:  # e.g. a layout or ISA we cannot read, no memory for the pool
            self.disabled = f"{type(exc).__name__}: {exc}"
            self.report.disabled = self.disabled  # the scheduler then stops claiming
            logger.warning(
                "SemShare disabled on this worker (requests are computed as usual; "
                "the scheduler stops claiming): %s",
                self.disabled,
            )
            self._assemble()
            return
        self._assemble()
        self.report.capacity = self.kv.store.capacity_bytes
        self.report.recompute_ready = self.kv.repairer is not None

    # ---- per step -----------------------------------------------------------------------------
    def start_load_kv(self, meta: SemShareConnectorMetadata) -> None:
        # whatever happens to them below, this step's output says these loads ran
        self.report.loads_done.extend(spec.seq for spec in meta.loads)
        if weight_updates.generation() != self._weights:
            self._weights_changed()
        for req_id in meta.restart_logprob_rows:
            self._restart_logprobs(req_id)
        if meta.reset:
            self._reset(meta)
            self._awaiting_reset = False
        elif self._awaiting_reset:
            self._refuse(meta)
        else:
            for key in meta.evictions:
                self._evict(key)
            for spec in meta.captures:
                self._capture(spec)
            if meta.captures_released:
                self._copy_captures_now()
        for spec in meta.loads:
            self._load(spec)
        for failed in meta.failed_loads:
            self.loads.fail(failed)

    @guarded("restarting prompt logprobs")
    def _restart_logprobs(self, req_id: str) -> None:
        self.loads.restart_logprobs(req_id)

    @guarded("dropping an evicted donor")
    def _evict(self, key: DonorKey) -> None:
        self.captures.settle(key)
        if self.kv is not None:
            if self.kv.tier is not None:
                self.kv.tier.forget(key)
            self.kv.store.drop(key)

    @guarded("dropping the donors of the old weights", on_fault="_reset_failed")
    def _weights_changed(self) -> None:
        """The model's weights were updated in place (``vllm_compat/weight_updates.py``), maybe
        with no connector reset to come: every donor of before is dropped now, as a reset drops
        them, so this step's loads of them fail and vLLM computes those tokens. The scheduler,
        told in this step's report, forgets them and answers with a reset; until then each
        capture is refused (``_refuse``): its KV may predate the update."""
        self._weights = weight_updates.generation()
        self._awaiting_reset = True
        self.report.weights_changed = True
        self.stats.add("weight_updates")
        self._reset(SemShareConnectorMetadata())

    def _refuse(self, meta: SemShareConnectorMetadata) -> None:
        """A step scheduled before the scheduler heard of a weight update: its captures are
        not taken (their blocks freed), its evictions dropped."""
        for spec in meta.captures:
            self.report.finished_sending.add(spec.req_id)
        if self.kv is not None:
            self.kv.store.forget_files(meta.evictions)  # donors of before: as a reset does

    @guarded("resetting", on_fault="_reset_failed")
    def _reset(self, meta: SemShareConnectorMetadata) -> None:
        """vLLM reset the connector (``SemShareConnectorMetadata.reset``): no donor of before
        serves again, from memory, disk or LMCache, and nothing is persisted or shared from now
        on. The step's captures are of requests computed before the reset, and its evictions
        every donor the scheduler knew."""
        for spec in meta.captures:  # their blocks are freed, their KV kept nowhere
            self.report.finished_sending.add(spec.req_id)
        if self.kv is None:
            return
        self.captures.drop_all()  # nothing of them reaches the store's disk or LMCache
        self.kv.store.forget_files(meta.evictions)  # in memory or only on disk
        self.kv.store.clear()
        tier, self.kv.tier = self.kv.tier, None
        if tier is not None:
            tier.close(cancel=True)  # puts not started are never made

    def _reset_failed(self, meta: SemShareConnectorMetadata | None = None) -> None:
        """Off for good (the scheduler stops claiming at the next output): nothing of before
        is served, and every block held for a capture is freed."""
        held = [job.spec for job in self.captures.jobs.values()]
        for spec in (meta.captures if meta is not None else []) + held:
            self.report.finished_sending.add(spec.req_id)
        self.disabled = self.report.disabled = "a connector reset failed"
        self.kv = None
        self._assemble()

    @guarded("copying captures whose blocks vLLM got back", on_fault="_drop_captures")
    def _copy_captures_now(self) -> None:
        """vLLM got back the blocks of the captures in flight (a reset of its prefix cache):
        they are copied before this step's loads and forward write into them."""
        self.captures.flush()

    def _drop_captures(self) -> None:
        """Their blocks freed, nothing kept, and the scheduler forgets them."""
        keys = list(self.captures.jobs)
        self.captures.drop_all()
        self.report.bad_donors.extend(keys)
        if self.kv is not None:
            for key in keys:
                self.kv.store.abort_write(key)

    @guarded("taking a capture", on_fault="_release")
    def _capture(self, spec: CaptureSpec) -> None:
        self.captures.take(spec)

    def _release(self, spec: CaptureSpec) -> None:
        self.report.finished_sending.add(spec.req_id)  # vLLM must free its blocks anyway
        self.report.bad_donors.append(spec.key)  # and the scheduler forget the donor

    @guarded("loading a donor", on_fault="_unload")
    def _load(self, spec: LoadSpec) -> None:
        self.loads.load(spec)

    def _unload(self, spec: LoadSpec) -> None:
        self.loads.invalidate(spec)  # vLLM counts these tokens as loaded: it must recompute

    @guarded("starting captures")
    def start_captures(self) -> None:
        """After the forward pass: copy this step's new donors out in the background."""
        self.captures.start()

    # ---- reports back to vLLM and the scheduler -----------------------------------------------
    @guarded("reporting finished captures", (None, None))
    def get_finished(
        self, finished_req_ids: set[str] = frozenset()
    ) -> tuple[set[str] | None, set[str] | None]:
        # vLLM sends a request's capture in the step that reports it finished: taken above
        self.captures.reap()
        return self.report.take_finished(finished_req_ids), None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.report.take_invalid_blocks()

    @guarded("reporting to the scheduler")
    def build_worker_meta(self) -> SemShareWorkerMetadata | None:
        if self.kv is not None and self.kv.tier is not None:
            self.kv.tier.reap()
        return self.report.take_worker_meta()

    @guarded("waiting for capture copies")
    def wait_for_copies(self) -> None:
        """Before vLLM unmaps the KV cache (sleep): every capture copy running is done (what
        becomes of them is decided at the next step, e.g. dropped by a connector reset)."""
        self.captures.wait_copies()

    # ---- end ----------------------------------------------------------------------------------
    def flush_captures(self) -> bool:
        """Wait for every capture in flight, and its tier put (tests, shutdown): whether the
        puts all ended (they are waited for ``tier.FLUSH_TIMEOUT_S`` at most)."""
        self.captures.flush()
        if self.kv is not None and self.kv.tier is not None:
            return self.kv.tier.flush()
        return True

    def shutdown(self) -> None:
        # vLLM may call this twice (explicitly, then from a finalizer at exit): the second
        # call must not submit to the capture thread it already shut down.
        if self._closed:
            return
        self._closed = True
        puts_ended = self.flush_captures()
        self.captures.close()
        self.loads.close()
        if self.kv is not None:
            if self.kv.tier is not None:
                # a stalled remote is never waited on
                self.kv.tier.close(cancel=not puts_ended, wait=puts_ended)
            self.kv.store.close()
