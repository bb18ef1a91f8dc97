"""Loads: donor KV written into the fresh blocks of a request that claimed it.

An exact load copies the donor's tokens as they are (the page spec's ``copy_tokens``); a
semantic load moves each aligned donor row to its own position, K re-rotated
(``gather_rearrange`` with RoPE), and is then repaired (``repair.py``). The donor is read from
the host store, from its own blocks while it is still being captured, or from the LMCache tier
when only that holds it.

A load that cannot be done reports its blocks through ``get_block_ids_with_load_errors``, so
vLLM recomputes them (the connector runs with ``kv_load_failure_policy="recompute"``).

On CPU a semantic load's move runs on a side thread (off the forward pass's cores) while the
repair runs the layers that read no donor KV (layer 0, where it recomputes every loaded
position and measures nothing there: every policy but "semsharekv"); the repair waits for the
move before the first layer that does (``_load_overlapped``).

Under tensor parallelism every worker runs the same loads, in the same order, each over its own
KV heads. The ranks agree twice per load (``vllm_compat.tensor_parallel.all_agree``): after the
copy and the repair's plan (all that can fail before the repair's first collective), and after
the repair; three times where the move runs beside layer 0 (after the plan, after the move,
after the repair). A load or repair that failed on one rank is failed on all of them, so every rank
reports the same blocks and none starts a repair (whose layers run collectives) that another
skipped. Each step that can fail on one rank only is caught on that rank first, so that every
rank always reaches every agreement.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from semshare_vllm.config import SemShareConfig
from semshare_vllm.core.counters import StatsRecorder
from semshare_vllm.kernels import gather_rearrange, move_aligned_rows, stage_rows
from semshare_vllm.layout.paged_cache import slots_for
from semshare_vllm.logs import guarded, warn_once
from semshare_vllm.metadata import FailedLoad, LoadSpec, RepairReport
from semshare_vllm.recompute.policy import Selection
from semshare_vllm.store.base import DonorNotReadNow, DonorUnavailable
from semshare_vllm.vllm_compat import model_hook, tensor_parallel
from semshare_vllm.vllm_compat.cpu_binding import connector_thread
from semshare_vllm.vllm_compat.prompt_logprobs import mark_served_rows, restart_rows
from semshare_vllm.worker.capture import Captures
from semshare_vllm.worker.repair import plan_repair, repair
from semshare_vllm.worker.reports import WorkerReport
from semshare_vllm.worker.setup import WorkerKV

logger = logging.getLogger("vllm.semshare.worker")


def moves_by_pages(cache: torch.Tensor) -> bool:
    """Whether semantic loads go page to page through the layout (``kernels.page_move``):
    on CPU, where the fused kernel's element-wise gather and scatter are slow; elsewhere the
    fused kernel (Triton on CUDA, its torch reference without Triton)."""
    return cache.device.type == "cpu"


class Loads:
    """``kv`` None: this worker holds no store (off), so every load fails for ``off``."""

    logger = logger  # for logs.guarded

    def __init__(
        self,
        kv: WorkerKV | None,
        off: str,
        captures: Captures,
        config: SemShareConfig,
        vllm_config,
        stats: StatsRecorder,
        report: WorkerReport,
    ):
        self.kv, self.off, self.captures = kv, off, captures
        self.config, self._vllm_config = config, vllm_config
        self.stats, self.report = stats, report
        # moves the donor KV beside the recompute (``_load_overlapped``)
        self._side = connector_thread("semshare-load")

    def load(self, spec: LoadSpec) -> None:
        """Copy, then repair, the donor KV ``spec`` claims; its blocks reported failed where
        either failed, here or on another tensor-parallel rank, or where the repair would
        attend over a prefix block a load failed to write (every rank reported the same
        blocks, so every rank decides alike, before any collective)."""
        prefix = spec.block_ids[: spec.dst_start // self.report.block_size]
        if spec.policy != "none" and self.report.unwritten(prefix):
            self.stats.add("loads_behind_unwritten_prefix")
            self.stats.add("load_failures")
            self.invalidate(spec)
            return
        if self._overlaps(spec):
            return self._load_overlapped(spec)
        load_ms = self._load_here(spec)
        here, selection, figures = load_ms is not None, None, None
        if here and spec.policy != "none":
            selection = self._plan_repair(spec)
            here = selection is not None
        agreed = tensor_parallel.all_agree(here)
        if agreed and selection is not None:
            figures = self._repair_here(spec, selection)
            if figures is not None:
                figures.load_ms = load_ms
            # declined: every rank decides alike (the same summed scores), none is a peer's
            # failure
            here = figures is not None and not figures.declined
            agreed = tensor_parallel.all_agree(here)
        self._settle(spec, here, agreed, figures)

    def _overlaps(self, spec: LoadSpec) -> bool:
        """Whether the donor KV is moved beside the recompute's first layer: semantic loads
        repaired on CPU, where the move is a host copy a spare core can run (on CUDA it is one
        kernel on the compute stream). Every tensor-parallel rank answers alike (the spec and
        the device), so every rank takes the same path and the same collectives."""
        return (
            self.kv is not None
            and self.kv.repairer is not None
            and spec.donor_pos is not None
            and spec.policy != "none"
            and moves_by_pages(self.kv.caches[0])
            # the move skips the first cache as layer 0's: it must be the runner's layer 0
            and getattr(self.kv.repairer.runner.layers[0], "cache", None) is self.kv.caches[0]
        )

    def _load_overlapped(self, spec: LoadSpec) -> None:
        """Plan the repair, agree on it, then move the donor KV on the side thread while the
        recompute runs the layers that do not read it (layer 0 recomputes every loaded
        position: ``first_donor_layer``); before the first that does, wait for the move and
        agree on it. Three agreements, in this order on every rank."""
        selection = self._plan_repair(spec)
        if not tensor_parallel.all_agree(selection is not None):
            self._settle(spec, selection is not None, False, None)
            return
        t0 = time.perf_counter()
        first, source, moving = self._start_move(spec, selection)
        source_ms = (time.perf_counter() - t0) * 1e3
        move = {"here": False, "exposed_ms": source_ms}

        def donor_kv_ready() -> bool:
            """Once, on this thread, whatever fails: the move waited for, counted and agreed
            on (the agreement is a collective: every rank makes it exactly once)."""
            if "agreed" in move:
                return move["agreed"]
            move["agreed"] = False
            waited = time.perf_counter()
            try:
                ms = None if moving is None else self._moved(spec, source, *moving.result())
            except Exception as exc:  # noqa: BLE001  (the agreement below must still happen)
                self._failed(spec, exc)
                ms = None
            move["here"] = ms is not None
            move["agreed"] = tensor_parallel.all_agree(ms is not None)
            move["exposed_ms"] = source_ms + (time.perf_counter() - waited) * 1e3
            return move["agreed"]

        figures = self._repair_here(spec, selection, (first, donor_kv_ready))
        donor_kv_ready()  # a recompute that ended before that layer: the agreement is every rank's
        if figures is not None:
            figures.load_ms = move["exposed_ms"]  # what the request waited for the move
        here = figures is not None and not figures.declined
        agreed = tensor_parallel.all_agree(here)
        # a move that failed only elsewhere stopped this rank's repair: a peer's failure
        self._settle(spec, here or (move["here"] and not move["agreed"]), agreed, figures)

    def _start_move(self, spec: LoadSpec, selection: Selection):
        """(first layer moved, the donor's source, the move's future); the future None where
        the move could not start (logged and counted): the agreement then fails it on every
        rank. Never raises, so that this rank reaches that agreement."""
        first = 0  # (what every rank uses if this fails: it reads only the spec and selection)
        try:
            first = first_donor_layer(spec, selection)
            source = self._source_of(spec)  # here: the tier's fetch, the captures' table
            if source is None:
                return first, None, None
            return first, source, self._side.submit(self._move, spec, source, first)
        except Exception as exc:  # noqa: BLE001
            self._failed(spec, exc)
            return first, None, None

    def _settle(self, spec: LoadSpec, here: bool, agreed: bool, figures) -> None:
        if not agreed:
            if here:  # only another rank failed: this one's KV is fine, but theirs is not
                self.stats.add("tp_peer_failures")
            self.invalidate(spec)
        # only once every rank repaired (a repair another rank failed is recomputed by vLLM,
        # and its figures must not describe the request), or where the gate declined (they say
        # why, and count towards the donor's demotion)
        if figures is not None and (agreed or figures.declined):
            if self.kv.repairer.reports_deviation:
                self.report.repaired(spec, figures)

    @guarded("planning a repair", None)
    def _plan_repair(self, spec: LoadSpec) -> Selection | None:
        return plan_repair(self.kv.repairer, spec, self.config, self.stats)

    @guarded("repairing a load", None)
    def _repair_here(
        self, spec: LoadSpec, selection: Selection, donor_kv_ready=None
    ) -> RepairReport | None:
        return repair(self.kv.repairer, spec, selection, self.stats, donor_kv_ready)

    @guarded("loading a donor", None)
    def _load_here(self, spec: LoadSpec) -> float | None:
        """This rank's copy, and how long it took (ms); None where it failed (the fault logged
        and counted). Never raises: every rank must go on to the agreement."""
        t0 = time.perf_counter()
        source = self._source_of(spec)
        if source is None:
            return None
        _, exc = self._move(spec, source)  # (timed here with finding the source)
        return self._moved(spec, source, (time.perf_counter() - t0) * 1e3, exc)

    def _source_of(self, spec: LoadSpec) -> _Source | None:
        """Where the donor is read from (its own blocks while it is being captured, the host
        store, the LMCache tier fetched into the store), resolved on the worker's thread; None
        where it cannot be loaded (logged and counted)."""
        if spec.mark_logprobs_until and not mark_served_rows(
            model_hook.loaded_runner(self._vllm_config), spec.req_id, spec.mark_logprobs_until
        ):
            # no rows to mark (another runner): vLLM computes, and scores, every position
            warn_once(
                logger,
                "logprobs",
                "SemShare: cannot mark the prompt logprobs of request %s; its prompt is computed",
                spec.req_id,
            )
            self.stats.add("load_failures")
            return None
        try:
            if self.kv is None:
                raise DonorUnavailable(self.off)
            held = self.captures.held(spec.key)
            if held is not None:  # still in its own blocks: copy block to block
                return _Source(held.block_ids, len(held.token_ids), True)
            donor_blocks = self._donor_blocks(spec)
            return _Source(donor_blocks, len(donor_blocks) * self.kv.block_size, False)
        except Exception as exc:
            self._failed(spec, exc)
            return None

    def _move(
        self, spec: LoadSpec, source: _Source, from_layer: int = 0
    ) -> tuple[float, Exception | None]:
        """Move the donor KV of layers ``from_layer`` on into the request's blocks: how long it
        took (ms), and what failed. Touches only the caches (it may run on the side thread)."""
        t0 = time.perf_counter()
        try:
            with torch.inference_mode():
                if spec.donor_pos is not None:
                    self._move_aligned(spec, source, from_layer)
                else:
                    self._copy_exact(spec, source, from_layer)
        except Exception as exc:
            return (time.perf_counter() - t0) * 1e3, exc
        return (time.perf_counter() - t0) * 1e3, None

    def _moved(
        self, spec: LoadSpec, source: _Source, ms: float, exc: Exception | None
    ) -> float | None:
        """A move's outcome counted (on the worker's thread): its time, or None where it
        failed."""
        if exc is not None:
            self._failed(spec, exc)
            return None
        self.stats.add("loaded_tokens", spec.num_tokens)
        if source.from_cache:
            self.stats.add("block_copied_tokens", spec.num_tokens)
        self.stats.add("load_ms", ms)
        return ms

    def _failed(self, spec: LoadSpec, exc: Exception) -> None:
        warn_once(
            logger,
            "load",
            "SemShare: loading donor %s for request %s failed (%s); its tokens are recomputed",
            spec.key.donor_id,
            spec.req_id,
            exc,
        )
        if isinstance(exc, DonorNotReadNow):  # a slow disk or remote: the donor stays
            self.stats.add("loads_not_read_in_time")
        else:
            self.report.bad_donors.append(spec.key)
        self.stats.add("load_failures")

    def close(self) -> None:
        self._side.shutdown(wait=True)

    def restart_logprobs(self, req_id: str) -> None:
        """A load that marked ``req_id``'s prompt-logprob rows failed (here or on another
        rank): vLLM now computes its prompt from the start, and scores every row again."""
        if not restart_rows(model_hook.loaded_runner(self._vllm_config), req_id):
            warn_once(
                logger,
                "logprobs-restart",
                "SemShare: cannot reset the prompt logprobs of request %s after its failed load",
                req_id,
            )
            self.stats.add("fallbacks")

    def fail(self, failed: FailedLoad) -> None:
        """A claim the scheduler could not plan: nothing is loaded, vLLM computes it."""
        self.report.fail_load(failed.req_id, failed.block_ids, failed.start, failed.num_tokens)
        self.stats.add("load_failures")

    def invalidate(self, spec: LoadSpec) -> None:
        """Report the loaded range's blocks as failed: vLLM recomputes those tokens."""
        self.report.fail_load(spec.req_id, spec.block_ids, spec.dst_start, spec.num_tokens)

    def _donor_blocks(self, spec: LoadSpec) -> list[int]:
        """The donor's host-store blocks; fetched from the LMCache tier into the host store
        first when the store does not hold it."""
        try:
            return self.kv.store.blocks(spec.key)
        except DonorUnavailable as exc:
            if self.kv.tier is None or not spec.donor_token_ids:
                raise
            stalled = exc if isinstance(exc, DonorNotReadNow) else None
        try:
            return self.kv.tier.fetch(spec, self.kv.store)
        except Exception as exc:
            # whatever LMCache said (absent, an error, another copy's digest), the donor's file
            # was not read: its disk is slow, not the donor bad, so it is kept
            if stalled is not None and not isinstance(exc, DonorNotReadNow):
                warn_once(
                    logger,
                    "tier-behind-stall",
                    "SemShare: LMCache, asked for a donor whose disk read stalled: %r",
                    exc,
                )
                raise stalled from exc
            raise

    def _stacks(self, source: _Source, from_layer: int):
        """(donor pages, request pages) per stack of layers, from layer ``from_layer`` on."""
        for layers, stack in self.kv.stacks:
            skip = max(0, from_layer - layers.start)
            if skip < stack.shape[0]:
                src = stack if source.from_cache else self.kv.store.pool[layers]
                yield src[skip:], stack[skip:]

    def _copy_exact(self, spec: LoadSpec, source: _Source, from_layer: int = 0) -> None:
        if source.tokens < spec.src_start + spec.num_tokens:
            raise DonorUnavailable(f"donor {spec.key.donor_id} is shorter than the claim")
        for src, dst in self._stacks(source, from_layer):
            self.kv.layout.copy_tokens(
                src,
                source.blocks,
                spec.src_start,
                dst,
                spec.block_ids,
                spec.dst_start,
                spec.num_tokens,
            )

    def _move_aligned(self, spec: LoadSpec, source: _Source, from_layer: int = 0) -> None:
        """Semantic load: each aligned position takes its donor row, K RoPE-corrected from the
        donor's position to its own (on CUDA ``kernels.gather_rearrange``, on CPU whole pages
        through the layout, ``kernels.page_move``); unaligned positions are left for the
        recompute, which redoes them in every layer."""
        repairer = self.kv.repairer
        if repairer is None:
            raise DonorUnavailable("no layer runner to repair a semantic load")
        donor_pos = np.asarray(spec.donor_pos, dtype=np.int64)
        aligned = np.flatnonzero(donor_pos >= 0)
        if not len(aligned):
            return
        if int(donor_pos[aligned].max()) >= source.tokens:
            raise DonorUnavailable(f"donor {spec.key.donor_id} is shorter than the alignment")
        if len(donor_pos) > spec.num_tokens:  # never write past the claimed range
            raise ValueError("the alignment is longer than the claim")
        if moves_by_pages(self.kv.caches[0]):
            for src, dst in self._stacks(source, from_layer):
                move_aligned_rows(
                    self.kv.layout,
                    src,
                    source.blocks,
                    dst,
                    spec.block_ids,
                    spec.dst_start,
                    donor_pos,
                    repairer.rope,
                )
            return
        rows, src_rows = np.unique(donor_pos[aligned], return_inverse=True)
        bs = self.kv.block_size
        donor_slots = slots_for(source.blocks, 0, int(rows[-1]) + 1, bs)[rows]
        target_pos = spec.dst_start + aligned
        dst_slots = slots_for(spec.block_ids, 0, spec.dst_start + spec.num_tokens, bs)[target_pos]
        src = torch.as_tensor(src_rows)
        # The donor's pages are read through their own offsets: the pool is contiguous, the
        # paged cache may be stride-permuted (vLLM's default GPU layout).
        src_offsets = repairer.offsets if source.from_cache else self.kv.store.offsets
        for pages, stack in self._stacks(source, from_layer):
            staged = stage_rows(pages, donor_slots, src_offsets)  # [layers, rows, H, 2D]
            gather_rearrange(
                staged,
                src,
                dst_slots,
                list(stack),
                repairer.offsets,
                repairer.rope,
                torch.as_tensor(rows)[src],
                torch.as_tensor(target_pos),
            )


@dataclass
class _Source:
    """Where a load reads its donor, resolved on the worker's thread."""

    blocks: list[int]  # the donor's blocks: in the host store's pool, or its own
    tokens: int  # positions they hold
    from_cache: bool  # its own blocks in vLLM's paged cache (still being captured)


def first_donor_layer(spec: LoadSpec, selection: Selection) -> int:
    """The first layer whose recompute reads the donor KV: 1 where layer 0 recomputes every
    loaded position and measures nothing against the donor there (so its donor KV is never
    read, nor moved), else 0."""
    whole = len(selection.start()) == spec.num_tokens
    return 1 if whole and not selection.wants_probe(0)[0] else 0
