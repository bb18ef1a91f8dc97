"""What the connector needs to know about the paged KV cache, read once from vLLM's configs.

Both halves compute the same ``KVGeometry`` from the same ``KVCacheConfig``, so the scheduler's
byte accounting and the worker's stored tensors agree, and persisted donors carry a fingerprint
of it (the workers report theirs at start-up: ``SemShareHandshake``). Models or parallel layouts
we cannot handle yet get ``unsupported`` set (with the reason) and the connector stays out of
their way: no claims, no captures.

The fingerprint also keys what changes the KV of the same tokens without changing its shape
(``layout/identity.py``: the weights, the model definition, quantisation, the KV cache dtype,
the vLLM version), so that donors persisted or shared by an engine running other weights are
never served as exact. Where nothing tells the weights from others (random weights, weights
streamed from a URL, a hub id with no snapshot in the cache), or the model's files changed
during or after the load, ``local_only`` says why: that engine persists and shares nothing.
Quantised KV with per-tensor fp8 scales gets ``exact_only`` (the reason): exact page copies stay
valid, the RoPE correction and the selective recompute (which ignore the scales) are off. Any
other quantised KV is ``unsupported``: a page copy would not carry its scales.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch

from semshare_vllm.layout.identity import (
    files_changed_since_load,
    kv_identity,
    unidentified_weights,
)
from semshare_vllm.vllm_compat import model_hook, weight_updates


@dataclass(frozen=True)
class KVGeometry:
    layer_names: tuple[str, ...]
    block_size: int
    num_kv_heads: int  # per tensor-parallel rank
    head_size: int
    dtype: torch.dtype
    tp_size: int
    fingerprint: str
    unsupported: str | None = None
    # Set (the reason) for quantised KV whose pages may be copied as they are, but not moved to
    # other positions or repaired: exact-prefix reuse only, no discovery, no recompute.
    exact_only: str | None = None
    # Set (the reason) when nothing tells these weights from others (random weights, weights
    # streamed from a URL, a hub id with no snapshot we can see): the fingerprint could not
    # tell a restart or another instance apart, so donors are neither persisted nor shared.
    local_only: str | None = None

    @property
    def bytes_per_token(self) -> int:
        """Bytes of one token's K and V over all layers, on one rank."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return len(self.layer_names) * 2 * self.num_kv_heads * self.head_size * itemsize

    def donor_bytes(self, num_tokens: int) -> int:
        """Host-store bytes of a donor: it keeps whole pages, the last one partly filled."""
        blocks = -(-num_tokens // self.block_size)
        return blocks * self.block_size * self.bytes_per_token


def kv_geometry(vllm_config, kv_cache_config) -> KVGeometry:
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    parallel = vllm_config.parallel_config
    groups = kv_cache_config.kv_cache_groups
    reason = None
    if len(groups) != 1:
        reason = f"{len(groups)} KV-cache groups (hybrid attention) are not supported yet"
    spec = groups[0].kv_cache_spec if groups else None
    if reason is None and type(spec) is not FullAttentionSpec:
        reason = f"KV-cache spec {type(spec).__name__} is not plain full attention"
    if reason is None and spec.head_size_v != spec.head_size:
        reason = "K and V head sizes differ"
    if reason is None and parallel.pipeline_parallel_size > 1:
        reason = "pipeline parallelism is not supported yet"
    context_parallel = max(
        getattr(parallel, "decode_context_parallel_size", 1),
        getattr(parallel, "prefill_context_parallel_size", 1),
    )
    if reason is None and context_parallel > 1:
        # a rank's blocks hold the request's tokens interleaved with other ranks', and vLLM
        # hashes blocks of block_size times the ranks
        reason = "context parallelism (decode or prefill) is not supported yet"
    if reason is not None and spec is None:
        return KVGeometry((), 1, 0, 0, torch.float32, parallel.tensor_parallel_size, "", reason)

    layer_names = tuple(groups[0].layer_names)
    heads = getattr(spec, "num_kv_heads", 0)
    head_size = getattr(spec, "head_size", 0)
    dtype = getattr(spec, "dtype", torch.float32)
    declined, exact_only = kv_quantisation(vllm_config, spec)
    reason = reason or declined
    identity, moved = _identity(vllm_config)
    fp = fingerprint(
        str(vllm_config.model_config.model),
        str(dtype),
        list(layer_names),
        heads,
        head_size,
        spec.block_size,
        parallel.tensor_parallel_size,
        extra=identity,
    )
    return KVGeometry(
        layer_names,
        spec.block_size,
        heads,
        head_size,
        dtype,
        parallel.tensor_parallel_size,
        fp,
        reason,
        exact_only,
        moved
        or unidentified_weights(
            identity, vllm_config.model_config, getattr(vllm_config, "load_config", None)
        )
        or weight_updates.plugin_left_out(),
    )


def _identity(vllm_config) -> tuple[dict, str | None]:
    """The identity of what this process loaded (taken just before the load, where the model
    hook saw it; else now), and why donors must stay in the process if the model's files
    changed during or since that load (the fingerprint would name weights not computed here),
    or could not be read (never a reason not to start)."""
    mc, lc = vllm_config.model_config, getattr(vllm_config, "load_config", None)
    try:
        at_load = model_hook.identity_at_load(vllm_config)
        if at_load is None:
            return kv_identity(vllm_config), None
        if at_load.changed_during_load:
            return at_load.identity, f"the files of {mc.model} changed while vLLM loaded them"
        if files_changed_since_load(at_load.identity, mc, lc):
            return at_load.identity, f"the files of {mc.model} changed after vLLM loaded them"
        return at_load.identity, None
    except Exception as exc:
        why = f"the model could not be identified ({type(exc).__name__}: {exc})"
        return {"unidentified": why}, why


# ---- KV formats ---------------------------------------------------------------------------------
_PLAIN_KV_DTYPES = frozenset({"auto", "float16", "bfloat16", "float32", "half", "float"})


def kv_quantisation(vllm_config, spec) -> tuple[str | None, str | None]:
    """(unsupported, exact_only) reasons for the KV cache dtype; (None, None) for plain KV."""
    from vllm.v1.kv_cache_interface import KVQuantMode, get_kv_quant_mode

    cache_config = getattr(vllm_config, "cache_config", None)
    cache_dtype = str(getattr(cache_config, "cache_dtype", None) or "auto")
    try:
        mode = get_kv_quant_mode(cache_dtype)
    except (KeyError, ValueError):  # a name vLLM's own table does not know
        mode = None
    spec_mode = getattr(spec, "kv_quant_mode", KVQuantMode.NONE)
    if mode == KVQuantMode.NONE and spec_mode != KVQuantMode.NONE:
        mode = spec_mode
    if mode == KVQuantMode.NONE and cache_dtype in _PLAIN_KV_DTYPES:
        return None, None
    if mode != KVQuantMode.FP8_PER_TENSOR:
        return (
            f"KV cache dtype {cache_dtype!r} ({getattr(mode, 'name', 'unknown')}) keeps "
            "its quantisation scales apart from the pages, or is not one the connector "
            "knows: a page copy would not carry them"
        ), None
    if getattr(cache_config, "calculate_kv_scales", False):
        return (
            f"KV cache dtype {cache_dtype!r} with calculate_kv_scales: the fp8 scales are "
            "computed per engine run, so pages copied from another run (or kept across "
            "the first batch) would be read with other scales"
        ), None
    return None, (
        f"KV cache dtype {cache_dtype!r} is quantised (per-tensor fp8 scales): exact "
        "page copies only; the RoPE correction and selective recompute ignore the "
        "scales, so semantic reuse and recompute are off"
    )


def fingerprint(
    model: str,
    dtype: str,
    layer_names: list[str],
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    tp_size: int,
    extra=None,
) -> str:
    """A short id of everything the scheduler knows that must match for stored KV to be reusable.
    ``extra``: anything else that changes the KV of the same tokens (the weights' identity,
    quantisation, RoPE, the KV cache dtype: ``layout/geometry.py``), JSON-able with sorted keys."""
    parts = [model, dtype, layer_names, num_kv_heads, head_size, block_size, tp_size]
    if extra is not None:
        parts.append(extra)
    blob = json.dumps(parts, sort_keys=True)
    return hashlib.blake2b(blob.encode(), digest_size=8).hexdigest()
