"""The worker half (each worker process): moves KV between the paged cache and the host store.

Per step, in ``start_load_kv``: drop evicted donors, take new captures (finished requests whose
blocks vLLM keeps for us: ``delay_free``), then load claimed tokens into the requests' fresh
blocks; a load whose donor is still being captured copies straight from the donor's blocks. In
``wait_for_save``, after the forward pass, the captures start on a background thread (paged cache
-> host store), so neither this step's forward nor its first tokens wait for them; each request
is reported in ``finished_sending`` when its copy is done, which frees its blocks.

With an LMCache tier (``kv_tier`` "lmcache"), each captured donor is also put there, on a thread
of its own (it may wait for a remote backend); with a shared index, that thread then marks the
donor's shard readable for other instances (``catalog.shared_index.KVReadyMarks``). A load whose
donor is not in the host store (another instance's donor, or one the pool let go) fetches it from
the tier into the host store first, then goes on as usual.

Nothing here may fail a request: a failed capture frees the blocks anyway and reports the donor
bad; a failed load reports its blocks through ``get_block_ids_with_load_errors`` so vLLM
recomputes them (the connector runs with ``kv_load_failure_policy="recompute"``).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from semshare_vllm.config import SemShareConfig
from semshare_vllm.core.keys import DonorKey
from semshare_vllm.kernels import PageAddressing, RopeTable, gather_rearrange, stage_rows
from semshare_vllm.layout.geometry import KVGeometry
from semshare_vllm.layout.kv_layout import (
    PageLayout,
    UnsupportedKVLayout,
    copy_blocks,
    copy_tokens,
    slots_for,
    stack_layers,
)
from semshare_vllm.logs import warn_once
from semshare_vllm.metadata import (
    CaptureSpec,
    LoadSpec,
    SemShareConnectorMetadata,
    SemShareWorkerMetadata,
)
from semshare_vllm.recompute.layer_runner import LayerRunner, UnsupportedModel
from semshare_vllm.recompute.policy import make_selection
from semshare_vllm.stats import StatsRecorder
from semshare_vllm.store.base import DonorKVStore
from semshare_vllm.store.host_store import DonorUnavailable, HostKVStore, fit_to_memory
from semshare_vllm.vllm_compat import model_hook
from semshare_vllm.vllm_compat.attention_layers import AttentionLayer, attention_layers
from semshare_vllm.vllm_compat.prompt_logprobs import mark_served_rows

logger = logging.getLogger("vllm.semshare.worker")


class SemShareWorker:
    def __init__(self, config: SemShareConfig, geometry: KVGeometry, vllm_config):
        self.config = config
        self.geometry = geometry
        self._vllm_config = vllm_config
        self.stats = StatsRecorder()
        self.caches: list[torch.Tensor] = []  # one paged KV tensor per layer, geometry order
        # The same as [layers, blocks, H, N, C] stacks (usually one): (layer range, tensor)
        self.stacks: list[tuple[slice, torch.Tensor]] = []
        self.layout: PageLayout | None = None
        self.store: HostKVStore | None = None
        self.tier: DonorKVStore | None = None  # LMCache (kv_tier), shared across instances
        self.runner: LayerRunner | None = None  # selective recompute (recompute_policy)
        self.rope: RopeTable | None = None
        self.addressing: PageAddressing | None = None
        self._ready_report: bool | None = None
        self._deviations: list[tuple[DonorKey, float]] = []   # measured per semantic load
        self._closed = False
        self.disabled: str | None = geometry.unsupported
        self._finished_sending: set[str] = set()
        # donor -> [its capture order, its pool blocks, the copy on the capture thread (None:
        # not started yet)]. These donors' pool blocks are never evicted.
        self._capturing: dict[DonorKey, list] = {}
        self._capture_thread = ThreadPoolExecutor(max_workers=1,
                                                  thread_name_prefix="semshare-capture")
        self._invalid_blocks: set[int] = set()
        # requests whose load failed, until vLLM says they finished: never captured (their
        # blocks may hold KV nobody wrote, if they end before vLLM recomputes it)
        self._failed_loads: set[str] = set()
        self._bad_donors: list[DonorKey] = []
        self._capacity_report: int | None = None
        self._disabled_report: str | None = None   # sent once (build_worker_meta)
        self._tier_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="semshare-tier")
        self._tier_puts: list[Future] = []
        self._ready_marks = None     # catalog.shared_index.KVReadyMarks, with shared_index_url
        # donor -> digest of the KV this rank put in the tier (a fetch back must match it: any
        # client of LMCache's remote backend could have written other KV under its keys)
        self._tier_digests: dict[DonorKey, str] = {}

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self.disabled:
            return
        try:
            layouts = set()
            layers = attention_layers(self._vllm_config, self.geometry.layer_names)
            for name in self.geometry.layer_names:
                layer = layers[name]
                layout = PageLayout(layer.backend, self.geometry.head_size, layer.cpu_isa)
                self._check_block_size(name, kv_caches[name], layer)
                if self.geometry.exact_only:
                    _check_whole_pages(kv_caches[name], self.geometry.head_size)
                else:
                    layout.view(kv_caches[name])  # raises for layouts we cannot read
                layouts.add(layout)
                self.caches.append(kv_caches[name])
            if len(layouts) != 1:
                raise UnsupportedKVLayout(f"layers differ in page layout: {layouts}")
            self.layout = layouts.pop()
            self.stacks = stack_layers(self.caches)
            self.store = self._make_store()
            self.runner = self._make_runner(kv_caches)
            self.tier = self._make_tier()
        except Exception as exc:  # e.g. a layout or ISA we cannot read, no memory for the pool
            self.disabled = f"{type(exc).__name__}: {exc}"
            self.caches, self.stacks, self.store = [], [], None
            self._disabled_report = self.disabled   # the scheduler then stops claiming
            logger.warning("SemShare disabled on this worker (requests are computed as usual; "
                           "the scheduler stops claiming): %s", self.disabled)
            return
        self._capacity_report = self.store.capacity_bytes
        self._ready_report = self.runner is not None

    def _check_block_size(self, name: str, cache: torch.Tensor, layer: AttentionLayer) -> None:
        """Loads, captures and the recompute address ``block_id * block_size + offset`` in the
        scheduler's blocks. A backend that splits them into smaller kernel blocks (vLLM's
        ``kernel_block_size``, ``map_kv_caches_to_kernel_blocks``) has other block ids and page
        sizes: refuse it, from the tensor registered, the view bound to the attention layer, or
        else the backend's declared kernel block sizes."""
        bs = self.geometry.block_size

        def refuse(what: str, n: int | None):
            has = f"has kernel blocks of {n} tokens" if n else f"takes no {bs}-token blocks"
            raise UnsupportedKVLayout(
                f"layer {name}: {what} {has}, the scheduler's blocks are {bs} tokens "
                "(kernel-block splitting is not supported"
                + (f"; serve with --block-size {n})" if n else ")"))

        if cache.dim() == 4 and cache.shape[2] != bs:
            refuse("the registered KV tensor", cache.shape[2])
        for t in layer.kv_cache_views:
            if t.shape[2] != bs:
                refuse("the attention layer's KV view", t.shape[2])
        sizes = layer.kernel_block_sizes
        if layer.kv_cache_views or sizes is None:   # (None: nothing more to check)
            return
        if not sizes.accepts(bs):
            fixed = [s for s in sizes.fixed if bs % s == 0]
            refuse(f"backend {layer.backend}", max(fixed) if fixed else None)

    def _make_runner(self, kv_caches: dict[str, torch.Tensor]) -> LayerRunner | None:
        """The layer runner over the model the plugin hook recorded, when recompute is on. Any
        problem turns recompute off with one warning: loads that need repair are then reported
        failed (vLLM computes those tokens); exact loads stay plain copies."""
        if self.config.recompute_policy == "none" or self.geometry.exact_only:
            return None    # quantised KV: the repair would ignore its scales (layout/geometry.py)
        if getattr(self._vllm_config, "lora_config", None) is not None:
            # The model's LoRA layers apply the adapters of the batch vLLM is running, by
            # position, not those of the request being repaired.
            logger.warning("SemShare: selective recompute (and so semantic reuse) is off on "
                           "this worker: LoRA is enabled; exact-prefix reuse stays on")
            return None
        model = model_hook.loaded_model(self._vllm_config)
        try:
            if model is None:
                raise UnsupportedModel(
                    "the plugin hook saw no model load (model runners wrapped: "
                    f"{', '.join(model_hook.installed()) or 'none'})")
            runner = LayerRunner(model, kv_caches, self.layout)
            # Semantic loads move donor rows to other positions: RoPE from the model's own
            # rotary module, one address scheme for this engine's pages.
            self.rope = RopeTable.from_vllm(model.model.layers[0].self_attn.rotary_emb)
            self.addressing = PageAddressing.from_layout(self.layout, self.caches[0])
            return runner
        except Exception as exc:
            logger.warning("SemShare: selective recompute is off on this worker: %s", exc)
            return None

    def _make_store(self) -> HostKVStore:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        root = None
        if self.config.persist_dir:
            root = Path(self.config.persist_dir) / self.geometry.fingerprint
        capacity = fit_to_memory(self.config.host_store_bytes, self.geometry.tp_size)
        cache = self.caches[0]
        return HostKVStore(capacity, list(self.geometry.layer_names), tuple(cache.shape[1:]),
                           cache.dtype, self.layout.name, get_tensor_model_parallel_rank(),
                           self.geometry.tp_size, root, pin_memory=cache.is_cuda,
                           page_layout=None if self.geometry.exact_only else self.layout)

    def _make_tier(self) -> DonorKVStore | None:
        """LMCache as the donors' second tier, when configured (and, with a shared index, the
        readiness keys other instances wait for). If it cannot be set up (the extra is not
        installed, a bad backend URL), this worker goes on with the host store alone, with one
        warning."""
        if self.config.kv_tier != "lmcache":
            return None
        if self.geometry.exact_only:
            logger.warning("SemShare: the LMCache tier is off on this worker (donors stay in the "
                           "host store of this instance): it moves KV as rows, and %s",
                           self.geometry.exact_only)
            return None
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        try:
            from semshare_vllm.store.lmcache_store import LMCacheKVStore

            g, rank = self.geometry, get_tensor_model_parallel_rank()
            if self.config.shared_index_url:
                from semshare_vllm.catalog.shared_index import KVReadyMarks

                self._ready_marks = KVReadyMarks(self.config.shared_index_url, g.fingerprint,
                                                 rank, self.config.shared_index_secret)
            return LMCacheKVStore(
                len(g.layer_names), g.num_kv_heads, g.head_size, g.dtype,
                model_name=g.fingerprint,   # keys differ wherever the KV geometry differs
                local_cpu_bytes=self.config.lmcache_local_cpu_bytes,
                remote_url=self.config.lmcache_remote_url, tp_rank=rank, tp_size=g.tp_size)
        except Exception as exc:
            logger.warning("SemShare: the LMCache tier is off on this worker (donors stay in "
                           "the host store of this instance): %s: %s", type(exc).__name__, exc)
            self._ready_marks = None
            return None

    # ---- per step -----------------------------------------------------------------------------
    def start_load_kv(self, meta: SemShareConnectorMetadata) -> None:
        for key in meta.evictions:
            self._settle(key)
            self._tier_digests.pop(key, None)
            if self.store is not None:
                self.store.drop(key)
        for spec in meta.captures:
            self._capture(spec)
        for spec in meta.loads:
            self._load(spec)

    def _capture(self, spec: CaptureSpec) -> None:
        try:
            if self.store is None:
                raise DonorUnavailable(self.disabled or "no host store")
            if spec.req_id in self._failed_loads:
                raise DonorUnavailable("its load failed")
            pool_blocks = self.store.allocate(spec.key, len(spec.block_ids), self._capturing)
        except DonorUnavailable as exc:
            warn_once(logger, "capture", "SemShare: request %s is not kept as a donor: %s",
                      spec.req_id, exc)
            self._finished_sending.add(spec.req_id)  # release its blocks, keep nothing
            self._bad_donors.append(spec.key)
            return
        self._capturing[spec.key] = [spec, pool_blocks, None]

    def start_captures(self) -> None:
        """After the forward pass: copy this step's new donors out in the background."""
        for entry in self._capturing.values():
            if entry[2] is None:
                entry[2] = self._capture_thread.submit(self._copy_out, entry[0], entry[1])

    def _copy_out(self, spec: CaptureSpec,
                  pool_blocks: list[int]) -> tuple[float, torch.Tensor | None]:
        """On the capture thread: gather the donor's pages from its blocks into its pool blocks
        (positions past its last token in its last block are never read). With a tier, also
        stage its rows for it (while the pool blocks are surely still this donor's)."""
        t0 = time.perf_counter()
        pool = self.store.pool
        with torch.inference_mode():
            for layers, stack in self.stacks:
                copy_blocks(stack, spec.block_ids, pool[layers], pool_blocks)
            if pool.is_pinned():
                torch.cuda.current_stream().synchronize()  # the D2H copies were asynchronous
            if self.store.persist_root is not None:
                self.store.persist(spec.key, spec.token_ids, pool[:, pool_blocks])  # a copy
            rows = None
            if self.tier is not None:
                n = len(spec.token_ids)
                rows = stage_rows(pool, slots_for(pool_blocks, 0, n, self.geometry.block_size),
                                  self.store.addressing)
        return (time.perf_counter() - t0) * 1e3, rows

    def _tier_put(self, key: DonorKey, token_ids: list[int], rows: torch.Tensor) -> float | None:
        """On the tier thread: milliseconds to a readable put, or None when it failed."""
        t0 = time.perf_counter()
        try:
            from semshare_vllm.catalog.shared_index import kv_digest

            digest = kv_digest(rows, getattr(self.tier, "dtype", None))
            kept = self.tier.put(key, token_ids, rows)
            if kept:
                self._tier_digests[key] = digest
            if kept and self._ready_marks is not None:
                # other instances may now load it, if what they fetch is what was put here
                kept = self._ready_marks.mark(key.donor_id, digest)
        except Exception as exc:
            warn_once(logger, "tier_put", "SemShare: putting donor %s in LMCache failed: %s",
                      key.donor_id, exc)
            kept = False
        return (time.perf_counter() - t0) * 1e3 if kept else None

    def _reap_tier_puts(self) -> None:
        """Count the tier puts done (their stats only: nothing waits for them here)."""
        for future in [f for f in self._tier_puts if f.done()]:
            self._tier_puts.remove(future)
            ms = future.result()
            if ms is None:
                self.stats.add("tier_put_failures")
            else:
                self.stats.add("tier_puts")
                self.stats.add("tier_put_ms", ms)

    def _reap(self, wait_for: DonorKey | None = None) -> None:
        """Account for finished captures (or wait for one); their blocks can then be freed."""
        for key, (spec, pool_blocks, future) in list(self._capturing.items()):
            if key == wait_for and future is None:
                future = self._capture_thread.submit(self._copy_out, spec, pool_blocks)
            if key != wait_for and (future is None or not future.done()):
                continue
            del self._capturing[key]
            self._finished_sending.add(spec.req_id)
            try:
                ms, rows = future.result()
            except Exception as exc:
                warn_once(logger, "capture_copy", "SemShare: capturing request %s failed; it is "
                          "not a donor", spec.req_id, exc_info=exc)
                self.store.drop_memory(key)
                self._bad_donors.append(key)
                continue
            self.stats.add("captured_donors")
            self.stats.add("captured_tokens", len(spec.token_ids))
            self.stats.add("capture_ms", ms)
            if rows is not None:
                self._tier_puts.append(self._tier_thread.submit(
                    self._tier_put, key, spec.token_ids, rows))

    def _settle(self, key: DonorKey) -> None:
        if key in self._capturing:
            self._reap(wait_for=key)

    def _load(self, spec: LoadSpec) -> None:
        if spec.policy == "fail":   # the scheduler could not plan this load: vLLM computes it
            self._invalidate(spec)
            self.stats.add("load_failures")
            return
        if spec.mark_logprobs_until and not mark_served_rows(
                model_hook.loaded_runner(self._vllm_config), spec.req_id,
                spec.mark_logprobs_until):
            # no rows to mark (another runner): vLLM computes, and scores, every position
            warn_once(logger, "logprobs", "SemShare: cannot mark the prompt logprobs of request "
                      "%s; its prompt is computed", spec.req_id)
            self._invalidate(spec)
            self.stats.add("load_failures")
            return
        t0 = time.perf_counter()
        try:
            if self.store is None:
                raise DonorUnavailable(self.disabled or "no host store")
            held = self._capturing.get(spec.key)
            if held is not None:  # still in its own blocks: copy block to block
                donor_tokens, donor_blocks = len(held[0].token_ids), held[0].block_ids
            else:
                donor_blocks = self._donor_blocks(spec)
                donor_tokens = len(donor_blocks) * self.geometry.block_size
            if spec.donor_pos is not None:
                self._move_aligned(spec, donor_blocks, donor_tokens, held is not None)
            else:
                if donor_tokens < spec.src_start + spec.num_tokens:
                    raise DonorUnavailable(f"donor {spec.key.donor_id} is shorter than the claim")
                for layers, stack in self.stacks:
                    src = stack if held is not None else self.store.pool[layers]
                    copy_tokens(src, donor_blocks, spec.src_start, stack, spec.block_ids,
                                spec.dst_start, spec.num_tokens, self.layout)
        except Exception as exc:
            warn_once(logger, "load", "SemShare: loading donor %s for request %s failed (%s); "
                      "its tokens are recomputed", spec.key.donor_id, spec.req_id, exc)
            self._invalidate(spec)
            self._bad_donors.append(spec.key)
            self.stats.add("load_failures")
            return
        self.stats.add("loaded_tokens", spec.num_tokens)
        if held is not None:
            self.stats.add("block_copied_tokens", spec.num_tokens)
        self.stats.add("load_ms", (time.perf_counter() - t0) * 1e3)
        if spec.policy != "none":
            self._recompute(spec)

    def _donor_blocks(self, spec: LoadSpec) -> list[int]:
        """The donor's host-store blocks; fetched from the LMCache tier into the host store
        first when the store does not hold it."""
        try:
            return self.store.blocks(spec.key, self._capturing)
        except DonorUnavailable:
            if self.tier is None or not spec.donor_token_ids:
                raise
        t0 = time.perf_counter()
        rows = self.tier.get(spec.key, spec.donor_token_ids)
        if rows is None:
            raise DonorUnavailable(f"donor {spec.key.donor_id} is in neither the host store "
                                   "nor LMCache")
        self._check_digest(spec, rows)
        if not self.store.put(spec.key, spec.donor_token_ids, rows, self._capturing):
            raise DonorUnavailable(f"donor {spec.key.donor_id} does not fit the host store")
        self.stats.add("tier_fetches")
        self.stats.add("tier_fetched_tokens", len(spec.donor_token_ids))
        self.stats.add("tier_fetch_ms", (time.perf_counter() - t0) * 1e3)
        return self.store.blocks(spec.key, self._capturing)

    def _check_digest(self, spec: LoadSpec, rows: torch.Tensor) -> None:
        """KV fetched from the tier is used only if it is what was put: another instance's
        donor, the digest its rank signed; this instance's, the digest this rank recorded when it
        put it. No digest (nothing to compare with): not used."""
        import hmac

        from semshare_vllm.catalog.shared_index import kv_digest

        if spec.donor_kv_digests is not None:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            rank = get_tensor_model_parallel_rank()
            digests = spec.donor_kv_digests
            expected = digests[rank] if rank < len(digests) else ""
        else:
            expected = self._tier_digests.get(spec.key, "")
        got = kv_digest(rows, getattr(self.tier, "dtype", None))
        if not hmac.compare_digest(got.encode(), str(expected).encode()):
            self.stats.add("tier_digest_mismatches")
            raise DonorUnavailable(f"donor {spec.key.donor_id}: the KV in LMCache is not what "
                                   "was put there (digest mismatch)")

    def _move_aligned(self, spec: LoadSpec, donor_blocks: list[int], donor_tokens: int,
                      from_cache: bool) -> None:
        """Semantic load: each aligned position takes its donor row, K RoPE-corrected from the
        donor's position to its own (``kernels.gather_rearrange``); unaligned positions are left
        for the recompute, which redoes them in every layer."""
        if self.runner is None or self.rope is None:
            raise DonorUnavailable("no layer runner to repair a semantic load")
        donor_pos = np.asarray(spec.donor_pos, dtype=np.int64)
        aligned = np.flatnonzero(donor_pos >= 0)
        if not len(aligned):
            return
        rows, src_rows = np.unique(donor_pos[aligned], return_inverse=True)
        if rows[-1] >= donor_tokens:
            raise DonorUnavailable(f"donor {spec.key.donor_id} is shorter than the alignment")
        bs = self.geometry.block_size
        donor_slots = slots_for(donor_blocks, 0, int(rows[-1]) + 1, bs)[rows]
        target_pos = spec.dst_start + aligned
        dst_slots = slots_for(spec.block_ids, 0, spec.dst_start + spec.num_tokens,
                              bs)[target_pos]
        src = torch.as_tensor(src_rows)
        for layers, stack in self.stacks:
            pages = stack if from_cache else self.store.pool[layers]
            staged = stage_rows(pages, donor_slots, self.addressing)  # [layers, rows, H, 2D]
            gather_rearrange(staged, src, dst_slots, list(stack), self.addressing, self.rope,
                             torch.as_tensor(rows)[src], torch.as_tensor(target_pos))

    def _invalidate(self, spec: LoadSpec) -> None:
        """Report the loaded range's blocks as failed: vLLM recomputes those tokens."""
        bs = self.geometry.block_size
        first, last = spec.dst_start // bs, (spec.dst_start + spec.num_tokens - 1) // bs
        self._invalid_blocks.update(spec.block_ids[first:last + 1])
        self._failed_loads.add(spec.req_id)

    def _recompute(self, spec: LoadSpec) -> None:
        end = spec.dst_start + spec.num_tokens
        if self.runner is None:  # unrepaired KV must not be used: vLLM computes these tokens
            self._invalidate(spec)
            self.stats.add("recompute_unavailable_tokens", spec.num_tokens)
            return
        t0 = time.perf_counter()
        try:
            selection = make_selection(spec.policy, np.arange(spec.dst_start, end),
                                       np.asarray(spec.always, dtype=np.int64), self.config)
            result = self.runner.recompute(spec.token_ids, spec.block_ids, selection,
                                           context=end)
        except Exception as exc:  # half-repaired KV must not be used: vLLM recomputes it
            warn_once(logger, "recompute", "SemShare: recompute for request %s failed (%s); its "
                      "loaded tokens are computed by vLLM", spec.req_id, exc)
            self._invalidate(spec)
            self.stats.add("recompute_failures")
            return
        if spec.donor_pos is not None and selection.measured is not None:
            self.stats.add("deviation_sum", selection.measured)
            self.stats.add("deviation_count")
            self._deviations.append((spec.key, selection.measured))
        self.stats.add("recomputed_tokens", max(result.per_layer, default=0))
        self.stats.add("recomputed_token_layers", sum(result.per_layer))
        self.stats.add("recompute_ms", (time.perf_counter() - t0) * 1e3)

    # ---- reports back to the scheduler --------------------------------------------------------
    def get_finished(self, finished_req_ids: set[str] = frozenset()
                     ) -> tuple[set[str] | None, set[str] | None]:
        # vLLM sends a request's capture in the step that reports it finished: taken above
        self._failed_loads.difference_update(finished_req_ids)
        self._reap()
        done, self._finished_sending = self._finished_sending, set()
        return (done or None), None

    def get_block_ids_with_load_errors(self) -> set[int]:
        bad, self._invalid_blocks = self._invalid_blocks, set()
        return bad

    def build_worker_meta(self) -> SemShareWorkerMetadata | None:
        self._reap_tier_puts()
        if not self._bad_donors and self._capacity_report is None and not self._deviations \
                and self._disabled_report is None:
            return None
        meta = SemShareWorkerMetadata(self._bad_donors, self._capacity_report,
                                      self._ready_report, self._deviations,
                                      self._disabled_report)
        self._bad_donors, self._capacity_report, self._ready_report = [], None, None
        self._deviations, self._disabled_report = [], None
        return meta

    def flush_captures(self) -> None:
        """Wait for every capture in flight, and its tier put (tests, shutdown)."""
        for key in list(self._capturing):
            self._settle(key)
        for future in list(self._tier_puts):
            future.result()

    def shutdown(self) -> None:
        # vLLM may call this twice (explicitly, then from a finalizer at exit): the second
        # call must not submit to the capture thread it already shut down.
        if self._closed:
            return
        self._closed = True
        self.flush_captures()
        self._capture_thread.shutdown(wait=True)
        self._tier_thread.shutdown(wait=True)
        if self.tier is not None:
            self.tier.close()
        if self._ready_marks is not None:
            self._ready_marks.close()
        if self.store is not None:
            self.store.close()


def _check_whole_pages(cache: torch.Tensor, head_size: int) -> None:
    """Quantised KV (``geometry.exact_only``) is only ever moved as whole pages, byte for byte:
    no per-token view (the CPU backend's element order is learnt by writing numbers through its
    cache op, which fp8 cannot hold exactly), only the page shape is checked."""
    if cache.dim() != 4 or cache.shape[3] != 2 * head_size:
        raise UnsupportedKVLayout(f"expected [B, H, N, {2 * head_size}] KV pages, got "
                                  f"{tuple(cache.shape)}")
