"""This worker's tensor-parallel rank, from vLLM's parallel state (which rank's KV shard the
worker holds, stores and checks).

``vllm.distributed.parallel_state.get_tensor_model_parallel_rank`` is the function vLLM's own
connectors call; it asserts that the tensor-parallel group exists, which it does in every worker
process by ``register_kv_caches``. Written against vLLM 0.32; 0.33 has the same function.
"""

from __future__ import annotations


def tp_rank() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank()
