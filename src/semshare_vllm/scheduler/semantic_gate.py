"""Whether this engine may serve semantic hits at all, decided once at start-up: where it may
not, the scheduler runs no donor search and claims exact prefixes only.

* Quantised KV (``KVGeometry.exact_only``): pages may be copied, never moved or repaired.
* Tensor parallelism, unless ``tp_semantic_reuse``: the ranks' agreement on the recomputed
  positions and on failures (``vllm_compat/tensor_parallel.py``) is tested end to end on vLLM's
  CPU build only, and a repair that went wrong there would hang or corrupt every rank.
"""

from __future__ import annotations

from semshare_vllm.config import SemShareConfig
from semshare_vllm.layout.geometry import KVGeometry


def semantic_refusal(config: SemShareConfig, geometry: KVGeometry) -> str | None:
    """Why this engine serves exact prefixes only, or None where semantic hits are allowed."""
    if geometry.exact_only:
        return geometry.exact_only
    if geometry.tp_size > 1 and not config.tp_semantic_reuse:
        return (
            f"semantic reuse is off under tensor parallelism (tensor_parallel_size="
            f"{geometry.tp_size}); tp_semantic_reuse=true turns it on (tested on vLLM's CPU "
            "build at TP=2, not yet with CUDA on several GPUs)"
        )
    return None
