"""What ``register_kv_caches`` checks and builds: the page layout of every layer (one for all,
one this worker can address), the host store, the LMCache tier and the repair engine.

A layout this worker cannot address raises, and the worker turns itself off. The tier and the
repair engine are optional: if either cannot be set up, the worker goes on without it, with one
warning.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from dataclasses import dataclass

import torch

from semshare_vllm.config import SemShareConfig
from semshare_vllm.kernels import RopeTable
from semshare_vllm.layout.geometry import KVGeometry
from semshare_vllm.layout.paged_cache import stack_layers
from semshare_vllm.layout.specs import PageSpec, UnsupportedKVLayout, page_spec
from semshare_vllm.recompute.layer_runner import LayerRunner, UnsupportedModel
from semshare_vllm.store.donor_file import persist_root
from semshare_vllm.store.host_store import PERSIST_BACKLOG_FRACTION, HostKVStore, fit_to_memory
from semshare_vllm.vllm_compat import model_hook, tensor_parallel
from semshare_vllm.vllm_compat.attention_layers import AttentionLayer, attention_layers
from semshare_vllm.worker.repair import Repairer
from semshare_vllm.worker.tier import Tier

logger = logging.getLogger("vllm.semshare.worker")


@dataclass
class WorkerKV:
    """vLLM's paged KV caches as this worker addresses them, and the donor stores beside."""

    caches: list[torch.Tensor]  # one paged KV tensor per layer, geometry order
    # The same as [layers, blocks, H, N, C] stacks (usually one): (layer range, tensor)
    stacks: list[tuple[slice, torch.Tensor]]
    layout: PageSpec
    block_size: int  # the scheduler's blocks (the kernels' too: checked)
    store: HostKVStore
    tier: Tier | None  # LMCache (kv_tier), shared across instances
    repairer: Repairer | None  # selective recompute (recompute_policy)


def build(
    kv_caches: dict[str, torch.Tensor],
    config: SemShareConfig,
    geometry: KVGeometry,
    vllm_config,
    stats,
) -> WorkerKV:
    """Raises for a layout this worker cannot address, or no memory for the pool."""
    layouts, caches = set(), []
    layers = attention_layers(vllm_config, geometry.layer_names)
    for name in geometry.layer_names:
        layer = layers[name]
        layout = page_spec(layer.backend, geometry.head_size, layer.cpu_isa)
        check_block_size(name, kv_caches[name], layer, geometry.block_size)
        if geometry.exact_only:
            check_whole_pages(kv_caches[name], geometry.head_size)
        else:
            layout.check(kv_caches[name])  # raises for layouts we cannot read
        layouts.add(layout)
        caches.append(kv_caches[name])
    if len(layouts) != 1:
        raise UnsupportedKVLayout(f"layers differ in page layout: {layouts}")
    layout, stacks = layouts.pop(), stack_layers(caches)
    rank = tensor_parallel.tp_rank()
    store = make_store(config, geometry, layout, caches[0], rank)
    repairer = make_repairer(config, geometry, vllm_config, kv_caches, layout, caches[0], rank)
    # rows waiting for LMCache hold at most what the disk's writes may (the capture's copies)
    backlog = int(PERSIST_BACKLOG_FRACTION * store.capacity_bytes)
    tier = make_tier(config, geometry, stats, rank, backlog)
    return WorkerKV(caches, stacks, layout, geometry.block_size, store, tier, repairer)


def check_block_size(name: str, cache: torch.Tensor, layer: AttentionLayer, bs: int) -> None:
    """Loads, captures and the recompute address ``block_id * block_size + offset`` in the
    scheduler's blocks. A backend that splits them into smaller kernel blocks (vLLM's
    ``kernel_block_size``, ``map_kv_caches_to_kernel_blocks``) has other block ids and page
    sizes: refuse it, from the tensor registered, the view bound to the attention layer, or
    else the backend's declared kernel block sizes."""

    def refuse(what: str, n: int | None):
        has = f"has kernel blocks of {n} tokens" if n else f"takes no {bs}-token blocks"
        raise UnsupportedKVLayout(
            f"layer {name}: {what} {has}, the scheduler's blocks are {bs} tokens "
            "(kernel-block splitting is not supported"
            + (f"; serve with --block-size {n})" if n else ")")
        )

    if cache.dim() == 4 and cache.shape[2] != bs:
        refuse("the registered KV tensor", cache.shape[2])
    for t in layer.kv_cache_views:
        if t.shape[2] != bs:
            refuse("the attention layer's KV view", t.shape[2])
    sizes = layer.kernel_block_sizes
    if layer.kv_cache_views or sizes is None:  # (None: nothing more to check)
        return
    if not sizes.accepts(bs):
        fixed = [s for s in sizes.fixed if bs % s == 0]
        refuse(f"backend {layer.backend}", max(fixed) if fixed else None)


def check_whole_pages(cache: torch.Tensor, head_size: int) -> None:
    """Quantised KV (``geometry.exact_only``) is only ever moved as whole pages, byte for byte:
    no per-token view (the CPU backend's element order is learnt by writing numbers through its
    cache op, which fp8 cannot hold exactly), only the page shape is checked."""
    if cache.dim() != 4 or cache.shape[3] != 2 * head_size:
        raise UnsupportedKVLayout(
            f"expected [B, H, N, {2 * head_size}] KV pages, got {tuple(cache.shape)}"
        )


def make_store(
    config: SemShareConfig, geometry: KVGeometry, layout: PageSpec, cache: torch.Tensor, rank: int
) -> HostKVStore:
    root = persist_root(config.persist_dir, geometry)
    capacity = fit_to_memory(config.host_store_bytes, geometry.tp_size)
    return HostKVStore(
        capacity,
        list(geometry.layer_names),
        tuple(cache.shape[1:]),
        cache.dtype,
        layout.name,
        rank,
        geometry.tp_size,
        root,
        pin_memory=cache.is_cuda,
        page_layout=None if geometry.exact_only else layout,
    )


def make_repairer(
    config: SemShareConfig,
    geometry: KVGeometry,
    vllm_config,
    kv_caches: dict[str, torch.Tensor],
    layout: PageSpec,
    cache: torch.Tensor,
    rank: int = 0,
) -> Repairer | None:
    """The layer runner over the model the plugin hook recorded, when recompute is on. Any
    problem turns recompute off with one warning: loads that need repair are then reported
    failed (vLLM computes those tokens); exact loads stay plain copies."""
    if config.recompute_policy == "none" or geometry.exact_only:
        return None  # quantised KV: the repair would ignore its scales (layout/geometry.py)
    if getattr(vllm_config, "lora_config", None) is not None:
        # The model's LoRA layers apply the adapters of the batch vLLM is running, by
        # position, not those of the request being repaired.
        logger.warning(
            "SemShare: selective recompute (and so semantic reuse) is off on "
            "this worker: LoRA is enabled; exact-prefix reuse stays on"
        )
        return None
    model = model_hook.loaded_model(vllm_config)
    try:
        if model is None:
            raise UnsupportedModel(
                "the plugin hook saw no model load (model runners wrapped: "
                f"{', '.join(model_hook.installed()) or 'none'})"
            )
        return Repairer(
            LayerRunner(
                model,
                kv_caches,
                layout,
                chunk_tokens=vllm_config.scheduler_config.max_num_batched_tokens,
            ),
            RopeTable.from_model(model),
            layout.offsets(cache),
            reports_deviation=rank == 0,
        )
    except Exception as exc:
        logger.warning("SemShare: selective recompute is off on this worker: %s", exc)
        return None


def make_tier(
    config: SemShareConfig, geometry: KVGeometry, stats, rank: int, backlog_bytes: int | None = None
) -> Tier | None:
    """LMCache as the donors' second tier, when configured (and, with a shared index, the
    readiness marks other instances wait for). If it cannot be set up (the extra is not
    installed, a bad backend URL), this worker goes on with the host store alone."""
    if config.kv_tier != "lmcache":
        return None
    if geometry.local_only:
        logger.warning(
            "SemShare: the LMCache tier is off on this worker (donors stay in this instance): %s",
            geometry.local_only,
        )
        return None
    if geometry.exact_only:
        logger.warning(
            "SemShare: the LMCache tier is off on this worker (donors stay in the "
            "host store of this instance): it moves KV as rows, and %s",
            geometry.exact_only,
        )
        return None
    marks = None
    try:
        from semshare_vllm.store.lmcache_store import LMCacheKVStore

        g = geometry
        if config.shared_index_url:
            from semshare_vllm.catalog.shared_index import KVReadyMarks

            marks = KVReadyMarks(
                config.shared_index_url, g.fingerprint, rank, config.shared_index_secret
            )
        build_store = functools.partial(
            LMCacheKVStore,
            len(g.layer_names),
            g.num_kv_heads,
            g.head_size,
            g.dtype,
            model_name=g.fingerprint,  # keys differ wherever the KV geometry differs
            local_cpu_bytes=config.lmcache_local_cpu_bytes,
            remote_url=config.lmcache_remote_url,
            tp_rank=rank,
            tp_size=g.tp_size,
        )
        return Tier(build_store, stats, rank, marks, backlog_bytes)  # (built on its thread)
    except Exception as exc:
        if marks is not None:
            with contextlib.suppress(Exception):
                marks.close()
        logger.warning(
            "SemShare: the LMCache tier is off on this worker (donors stay in "
            "the host store of this instance): %s: %s",
            type(exc).__name__,
            exc,
        )
        return None
