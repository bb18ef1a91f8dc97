"""What the connector needs to know about the paged KV cache, read once from vLLM's configs.

Both halves compute the same ``KVGeometry`` from the same ``KVCacheConfig``, so the scheduler's
byte accounting and the worker's stored tensors agree, and persisted donors carry a fingerprint
of it. Models or parallel layouts we cannot handle yet get ``unsupported`` set (with the reason)
and the connector stays out of their way: no claims, no captures.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from semshare_vllm import donor_file


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
    if reason is not None and spec is None:
        return KVGeometry((), 1, 0, 0, torch.float32, parallel.tensor_parallel_size, "", reason)

    layer_names = tuple(groups[0].layer_names)
    heads = getattr(spec, "num_kv_heads", 0)
    head_size = getattr(spec, "head_size", 0)
    dtype = getattr(spec, "dtype", torch.float32)
    fp = donor_file.fingerprint(str(vllm_config.model_config.model), str(dtype),
                                list(layer_names), heads, head_size, spec.block_size,
                                parallel.tensor_parallel_size)
    return KVGeometry(layer_names, spec.block_size, heads, head_size, dtype,
                      parallel.tensor_parallel_size, fp, reason)
