"""``SemShareConnector``: the class vLLM loads. Thin: it validates the config and delegates to the
scheduler half (``scheduler/``) or the worker half (``worker/``).

    vllm serve MODEL --kv-transfer-config '{"kv_connector":"SemShareConnector",
        "kv_connector_module_path":"semshare_vllm.connector","kv_role":"kv_both"}'

vLLM imports this module in the API server, the engine core, every worker and the stat loggers,
so importing it loads no model and allocates nothing.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from semshare_vllm.alignment import AlignParams
from semshare_vllm.config import SemShareConfig
from semshare_vllm.core.counters import StatsRecorder
from semshare_vllm.discovery.service import build_discovery
from semshare_vllm.layout.geometry import kv_geometry
from semshare_vllm.metadata import SemShareConnectorMetadata, SemShareHandshake
from semshare_vllm.scheduler import SemShareScheduler
from semshare_vllm.scheduler.planner import Aligner
from semshare_vllm.scheduler.semantic_gate import semantic_refusal
from semshare_vllm.stats import SemSharePromMetrics, SemShareStats
from semshare_vllm.vllm_compat import connector_registry, in_flight_failures
from semshare_vllm.worker import SemShareWorker

logger = logging.getLogger("vllm.semshare")


def shared_donor_feed(
    config: SemShareConfig,
    geometry,
    max_tokens: int | None = None,
    stats: StatsRecorder | None = None,
):
    """The shared donor index (``shared_index_url``, records signed with
    ``shared_index_secret``), or None (unset, or the ``[lmcache]`` extra that brings redis-py
    missing: this instance then keeps its donors to itself, with one warning). Records must have
    this engine's tensor-parallel size and at most ``max_tokens`` tokens (its max_model_len)."""
    if not config.shared_index_url:
        return None
    try:
        from semshare_vllm.catalog.shared_index import SharedDonorFeed
        from semshare_vllm.catalog.shared_records import MAX_TOKENS

        return SharedDonorFeed(
            config.shared_index_url,
            geometry.fingerprint,
            secret=config.shared_index_secret,
            tp_size=geometry.tp_size,
            max_tokens=max_tokens or MAX_TOKENS,
            stats=stats,
        )
    except Exception as exc:
        logger.warning(
            "SemShare: the shared donor index is off (this instance's donors only): %s: %s",
            type(exc).__name__,
            exc,
        )
        return None


class SemShareConnector(KVConnectorBase_V1):
    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.config = SemShareConfig.from_extra_config(extra)
        geometry = kv_geometry(vllm_config, kv_cache_config)
        self.scheduler: SemShareScheduler | None = None
        self.worker: SemShareWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            # A donor that cannot be loaded must cost a recompute, never the request: vLLM reads
            # this policy right after building the scheduler-side connector.
            if self._kv_transfer_config.kv_load_failure_policy != "recompute":
                logger.info(
                    "SemShare: kv_load_failure_policy %r -> 'recompute' (a donor that "
                    "cannot be loaded is recomputed, never fails the request)",
                    self._kv_transfer_config.kv_load_failure_policy,
                )
                self._kv_transfer_config.kv_load_failure_policy = "recompute"
            # with async scheduling, a failed load's next step is already running over it
            in_flight_failures.install()
            # No semantic hits for this engine (quantised KV, tensor parallelism): no donor
            # search to run (the scheduler half says why, once).
            stats = StatsRecorder()  # the scheduler half's, which discovery and the feed share
            discovery = (
                None
                if geometry.unsupported or semantic_refusal(self.config, geometry)
                else build_discovery(self.config, vllm_config.model_config.tokenizer, stats)
            )
            aligner = (
                None
                if discovery is None
                else Aligner(
                    AlignParams.from_config(self.config),
                    vllm_config.model_config.model,
                    vllm_config.model_config.tokenizer,
                    self.config.embedding_sketch_dim,
                    echoes=self.config.recompute_echo_span > 0,
                )
            )
            # exact_only: no LMCache tier on the worker, so shared donors could not be fetched;
            # local_only: nothing would tell this engine's donors from other weights'
            feed = (
                None
                if geometry.unsupported or geometry.exact_only or geometry.local_only
                else shared_donor_feed(
                    self.config, geometry, vllm_config.model_config.max_model_len, stats
                )
            )
            self.scheduler = SemShareScheduler(
                self.config, geometry, discovery, aligner, feed, stats
            )
            logger.info("SemShare connector (scheduler) ready: %s", self.config.describe())
        else:
            self.worker = SemShareWorker(self.config, geometry, vllm_config)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # vLLM calls this while building its config, in the API server: the earliest point at
        # which a bad key can stop start-up with a clear message.
        SemShareConfig.from_extra_config(extra_config)
        return False

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config) -> str | None:
        # Called while the engine core sets up the KV cache, before any request: validate there
        # too, for backends where the CUDA-graph hook above is not consulted (CPU, eager).
        SemShareConfig.from_extra_config(vllm_config.kv_transfer_config.kv_connector_extra_config)
        return None  # every layout has a page spec (layout/specs/)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a lost capture is a future miss, nothing more

    # ---- scheduler side -----------------------------------------------------------------------
    def on_new_request(self, request) -> None:
        self.scheduler.on_new_request(request)  # starts the donor search off this thread

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request, block_ids: list[int]):
        return self.scheduler.request_finished(request, block_ids)

    def update_connector_output(self, connector_output) -> None:
        self.scheduler.update_connector_output(connector_output)

    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self.scheduler is not None:  # failed loads' blocks leave vLLM's prefix cache
            self.scheduler.bind_kv_cache_manager(kv_cache_manager)

    def has_pending_block_frees(self) -> bool:
        return self.scheduler is not None and self.scheduler.has_pending_block_frees()

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        # every worker's SemShareHandshake, once the engine is built and before any request
        if self.scheduler is not None:
            self.scheduler.confirm_workers(metadata)

    def reset_cache(self) -> bool | None:
        # vLLM's reset_prefix_cache(reset_connector=True), which its pause and sleep call
        return self.scheduler.reset_cache() if self.scheduler is not None else None

    # ---- worker side --------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def unregister_kv_caches(self) -> None:
        # vLLM 0.33 calls it before sleep unmaps the KV cache (its pause gave back the blocks
        # held for captures): no capture may still be reading them
        if self.worker is not None:
            self.worker.wait_for_copies()

    def start_load_kv(self, forward_context, **kwargs) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, SemShareConnectorMetadata)
        self.worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs
    ) -> None:
        return None

    def wait_for_save(self) -> None:
        self.worker.start_captures()  # after the forward: nothing in this step waits for them

    def get_finished(self, finished_req_ids: set[str]):
        return self.worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors()

    def get_handshake_metadata(self) -> SemShareHandshake | None:
        # (inside a MultiConnector: none, and the scheduler half compares nothing)
        if (
            self.worker is None
            or self.worker.geometry.unsupported
            or not connector_registry.serves_alone(self)
        ):
            return None
        g = self.worker.geometry
        return SemShareHandshake(g.fingerprint, g.local_only)

    def build_connector_worker_meta(self):
        return self.worker.build_worker_meta() if self.worker is not None else None

    # ---- both ---------------------------------------------------------------------------------
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self.scheduler is not None:
            return SemShareStats.of(self.scheduler.take_stats())
        return SemShareStats.of(self.worker.stats.take())

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return SemShareStats(data=dict(data)) if data is not None else SemShareStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return SemSharePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
        if self.scheduler is not None:
            self.scheduler.shutdown()
