"""What the connector needs to know about the paged KV cache, read once from vLLM's configs.

Both halves compute the same ``KVGeometry`` from the same ``KVCacheConfig``, so the scheduler's
byte accounting and the worker's stored tensors agree, and persisted donors carry a fingerprint
of it. Models or parallel layouts we cannot handle yet get ``unsupported`` set (with the reason)
and the connector stays out of their way: no claims, no captures.

The fingerprint also keys what changes the KV of the same tokens without changing its shape: the
weights' and model code's identity (a new checkpoint at the same path), how they are loaded, their
quantisation, RoPE (overrides, and ``max_model_len``, by which vLLM picks LongRoPE's factors), the
KV cache dtype and the vLLM version, so that donors persisted or shared by an engine running other
weights are never served as exact. Where nothing tells the weights from others (random weights,
weights streamed from a URL, a hub id with no snapshot in the cache), ``local_only`` says why:
that engine persists and shares nothing. Quantised KV with per-tensor fp8 scales gets
``exact_only`` (the reason): exact page copies stay valid, the RoPE correction and the selective
recompute (which ignore the scales) are off. Any other quantised KV is ``unsupported``: a page
copy would not carry its scales.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from semshare_vllm.core.files import file_stats, hub_snapshot
from semshare_vllm.vllm_compat import weight_updates


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
    identity = kv_identity(vllm_config)
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
        unidentified_weights(identity, vllm_config.model_config)
        or weight_updates.plugin_left_out(),
    )


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


# ---- what else keys the KV of the same tokens ----------------------------------------------------
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".index.json")
# A local model's own code (``trust_remote_code``) computes its KV as much as its weights do.
_MODEL_FILE_SUFFIXES = _WEIGHT_SUFFIXES + (".py",)
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _stable(obj):
    """A JSON value for ``obj`` that is the same in every process (no object addresses)."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, dict):
        return {str(k): _stable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        items = [_stable(v) for v in obj]
        return sorted(items, key=repr) if isinstance(obj, (set, frozenset)) else items
    if callable(obj) and hasattr(obj, "__qualname__"):
        return f"{getattr(obj, '__module__', '?')}.{obj.__qualname__}"
    to_dict = getattr(obj, "to_dict", None)
    if callable(to_dict):
        try:
            return _stable(to_dict())
        except Exception:
            pass
    return _ADDRESS.sub("", repr(obj))


def _local_weights(path: Path) -> dict:
    """Names, sizes and mtimes of a local model's weight and code files, and its config.json's
    hash: a new checkpoint written at the same path changes it, and no weight byte is read."""
    files = (
        [path]
        if path.is_file()
        else sorted(p for p in path.iterdir() if p.name.endswith(_MODEL_FILE_SUFFIXES))
    )
    out = {"files": file_stats(files)}
    config = (path if path.is_dir() else path.parent) / "config.json"
    try:
        out["config"] = hashlib.blake2b(config.read_bytes(), digest_size=16).hexdigest()
    except OSError:
        out["config"] = None
    return out


def weights_identity(model_config, load_config=None) -> dict:
    model = str(getattr(model_config, "model", ""))
    revision = getattr(model_config, "revision", None)
    if os.path.exists(model):
        return {"local": _local_weights(Path(model))}
    cache_dir = getattr(load_config, "download_dir", None)
    commit = hub_snapshot(model, revision, cache_dir)
    return {"hub": model, "commit": commit, "revision": None if commit else revision}


def unidentified_weights(identity: dict, model_config) -> str | None:
    """Why ``identity`` (``kv_identity``'s) tells these weights from no other weights under the
    same name, or None. Then a fingerprint cannot key them: their donors stay in this process."""
    if identity["load_format"] == "dummy":
        return "load_format 'dummy' computes with random weights"
    model = str(getattr(model_config, "model", ""))
    streamed = str(getattr(model_config, "model_weights", "") or "")
    if streamed and streamed != model:
        return f"the weights are streamed from {streamed}, whose version is not known here"
    weights = identity["weights"]
    if "local" in weights:
        names = [name for name, _, _ in weights["local"]["files"]]
        if os.path.isdir(model) and not any(n.endswith(_WEIGHT_SUFFIXES) for n in names):
            return f"no weight files in {model}"
        return None
    if weights["commit"] is None:
        return f"{model} is neither a local path nor a hub snapshot in the cache vLLM reads"
    return None


def kv_identity(vllm_config) -> dict:
    """What changes the KV of the same tokens at the same shape: the weights (their identity,
    how they are loaded, quantisation, dtype), RoPE (overrides, scaling, theta, and
    ``max_model_len``, by which vLLM picks LongRoPE's factors), the KV cache dtype, and the vLLM
    that computed and laid out the pages."""
    import vllm

    mc = vllm_config.model_config
    cache_config = getattr(vllm_config, "cache_config", None)
    rope = {}
    hf_configs = [getattr(mc, "hf_config", None), getattr(mc, "hf_text_config", None)]
    for i, hf in enumerate(c for c in hf_configs if c is not None):
        if i and hf is hf_configs[0]:
            continue
        for name in (
            "rope_scaling",
            "rope_theta",
            "rope_parameters",
            "max_position_embeddings",
            "partial_rotary_factor",
        ):
            rope[f"{i}.{name}"] = getattr(hf, name, None)
    return _stable(
        {
            "weights": weights_identity(mc, getattr(vllm_config, "load_config", None)),
            "load_format": str(
                getattr(getattr(vllm_config, "load_config", None), "load_format", "auto") or "auto"
            ).lower(),
            "max_model_len": getattr(mc, "max_model_len", None),
            "code_revision": getattr(mc, "code_revision", None),  # a hub model's remote code
            "vllm": getattr(vllm, "__version__", None),
            "quantization": getattr(mc, "quantization", None),
            "model_dtype": str(getattr(mc, "dtype", None)),
            "hf_overrides": getattr(mc, "hf_overrides", None),
            "rope": rope,
            "cache_dtype": str(getattr(cache_config, "cache_dtype", None) or "auto"),
        }
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
