"""Capture: a finished request's KV, copied out of vLLM's paged cache into the host store.

vLLM keeps a finished request's blocks for us (``delay_free``) until the worker reports it in
``finished_sending``. A capture is taken in ``start_load_kv`` (pool blocks allocated), started on
a background thread after the forward pass (``start``), so that neither this step's forward nor
its first tokens wait for it, and reaped once done, which frees the request's blocks. A load
whose donor is still being captured copies from the donor's own blocks (``held``).

Nothing here may fail a request: a failed capture frees the blocks anyway and reports the donor
bad.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from semshare_vllm.core.counters import StatsRecorder
from semshare_vllm.core.keys import DonorKey
from semshare_vllm.kernels import stage_rows
from semshare_vllm.layout.paged_cache import slots_for
from semshare_vllm.logs import warn_once
from semshare_vllm.metadata import CaptureSpec
from semshare_vllm.store.base import DonorUnavailable
from semshare_vllm.vllm_compat.cpu_binding import connector_thread
from semshare_vllm.worker.reports import WorkerReport
from semshare_vllm.worker.setup import WorkerKV

logger = logging.getLogger("vllm.semshare.worker")


@dataclass
class CaptureJob:
    spec: CaptureSpec
    pool_blocks: list[int]  # the donor's blocks in the host store's pool
    copy: Future | None = None  # on the capture thread; None: not started yet
    # set on the capture thread: the disk's / LMCache's backlog was full
    persist_skipped: bool = False
    tier_skipped: bool = False


class Captures:
    """The captures in flight. ``kv`` None: this worker holds no store (off), so every capture
    is refused (its blocks freed, nothing kept) for the reason ``off``."""

    def __init__(self, kv: WorkerKV | None, off: str, stats: StatsRecorder, report: WorkerReport):
        self.kv, self.off = kv, off
        self.stats, self.report = stats, report
        self.jobs: dict[DonorKey, CaptureJob] = {}
        self._thread = connector_thread("semshare-capture")

    def take(self, spec: CaptureSpec) -> None:
        """Allocate the donor's pool blocks; the copy starts after the forward (``start``)."""
        if spec.key in self.jobs:
            # The same tokens again in this step (the scheduler evicted the donor and a sibling
            # made it anew): the same KV, copied once. Its request is released now; replacing
            # the first job instead would never report that one, and vLLM would keep its
            # blocks for good (and stop preempting while a capture is pending).
            self.report.finished_sending.add(spec.req_id)
            return
        try:
            if self.kv is None:
                raise DonorUnavailable(self.off)
            if spec.req_id in self.report.failed_loads:
                raise DonorUnavailable("its load failed")
            pool_blocks = self.kv.store.allocate(spec.key, len(spec.block_ids))
        except DonorUnavailable as exc:
            warn_once(
                logger,
                "capture",
                "SemShare: request %s is not kept as a donor: %s",
                spec.req_id,
                exc,
            )
            self.report.finished_sending.add(spec.req_id)  # release its blocks, keep nothing
            self.report.bad_donors.append(spec.key)
            return
        self.jobs[spec.key] = CaptureJob(spec, pool_blocks)

    def held(self, key: DonorKey) -> CaptureSpec | None:
        """The donor's capture, while it is still in its own blocks."""
        job = self.jobs.get(key)
        return None if job is None else job.spec

    def start(self) -> None:
        """After the forward pass: copy this step's new donors out in the background."""
        for job in self.jobs.values():
            if job.copy is None:
                job.copy = self._thread.submit(self._copy_out, job)

    def _copy_out(self, job: CaptureJob) -> tuple[float, torch.Tensor | None]:
        """On the capture thread: gather the donor's pages from its blocks into its pool blocks
        (positions past its last token in its last block are never read). With a tier, also
        stage its rows for it, while the pool blocks are surely still this donor's."""
        t0 = time.perf_counter()
        kv, spec = self.kv, job.spec
        pool = kv.store.pool
        device = kv.stacks[0][1].device
        if device.type == "cuda":
            # A new thread's current device is 0: on another rank that is another GPU, whose
            # stream the wait below would wait on (and a context opened there)
            torch.cuda.set_device(device)
        with torch.inference_mode():
            for layers, stack in kv.stacks:
                kv.layout.copy_blocks(stack, spec.block_ids, pool[layers], job.pool_blocks)
            if pool.is_pinned():  # the D2H copies were asynchronous, on this thread's stream
                torch.cuda.current_stream(device).synchronize()
            nbytes = len(job.pool_blocks) * kv.store.block_bytes
            if kv.store.persist_root is not None:
                if kv.store.persist_room(nbytes):
                    kv.store.persist(  # (the pages: a copy)
                        spec.key, spec.token_ids, pool[:, job.pool_blocks], spec.num_prompt_tokens
                    )
                else:  # the disk is behind: this donor stays memory-only
                    job.persist_skipped = True
            rows = None
            if kv.tier is not None and not kv.tier.room(nbytes):
                job.tier_skipped = True  # LMCache is behind: this donor stays in this instance
            elif kv.tier is not None:
                n = len(spec.token_ids)
                rows = stage_rows(
                    pool, slots_for(job.pool_blocks, 0, n, kv.block_size), kv.store.offsets
                )
        return (time.perf_counter() - t0) * 1e3, rows

    def reap(self, wait_for: DonorKey | None = None) -> None:
        """Account for finished captures (or wait for one); their blocks can then be freed."""
        for key, job in list(self.jobs.items()):
            if key == wait_for and job.copy is None:
                job.copy = self._thread.submit(self._copy_out, job)
            if key != wait_for and (job.copy is None or not job.copy.done()):
                continue
            del self.jobs[key]
            self.report.finished_sending.add(job.spec.req_id)
            try:
                ms, rows = job.copy.result()
            except Exception as exc:
                warn_once(
                    logger,
                    "capture_copy",
                    "SemShare: capturing request %s failed; it is not a donor",
                    job.spec.req_id,
                    exc_info=exc,
                )
                self.kv.store.abort_write(key)
                self.report.bad_donors.append(key)
                continue
            self.kv.store.finish_write(key)
            self.stats.add("captured_donors")
            self.stats.add("captured_tokens", len(job.spec.token_ids))
            self.stats.add("capture_ms", ms)
            if job.persist_skipped:
                self.stats.add("persist_backlog_skipped")
                warn_once(
                    logger,
                    "persist_backlog",
                    "SemShare: persist_dir's disk is behind the captures; donors past its "
                    "backlog stay memory-only (counted as persist_backlog_skipped)",
                )
            if job.tier_skipped:
                self.stats.add("tier_backlog_skipped")
                warn_once(
                    logger,
                    "tier_backlog",
                    "SemShare: LMCache is behind the captures; donors past its backlog stay in "
                    "this instance (counted as tier_backlog_skipped)",
                )
            if rows is not None:
                self.kv.tier.put_later(key, job.spec.token_ids, rows)

    def settle(self, key: DonorKey) -> None:
        """Wait for the donor's capture, if it has one in flight (before it is dropped)."""
        if key in self.jobs:
            self.reap(wait_for=key)

    def flush(self) -> None:
        for key in list(self.jobs):
            self.settle(key)

    def wait_copies(self) -> None:
        """Wait for every copy started (its outcome is taken later, by ``reap``)."""
        for job in self.jobs.values():
            if job.copy is not None:
                try:
                    job.copy.result()
                except Exception:
                    pass  # reported when reaped

    def drop_all(self) -> None:
        """A connector reset: every capture in flight ends here, its blocks freed and nothing
        kept (the caller clears the store)."""
        self.wait_copies()  # they write into pool blocks
        for job in self.jobs.values():
            self.report.finished_sending.add(job.spec.req_id)
        self.jobs.clear()

    def close(self) -> None:
        self._thread.shutdown(wait=True)
