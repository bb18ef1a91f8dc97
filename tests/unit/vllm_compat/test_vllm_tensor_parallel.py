"""``vllm_compat.tensor_parallel`` on vLLM's real parallel state: a single-process group gives
rank 0 (the worker's KV shard), and without a group vLLM's function refuses (it is only called
from ``register_kv_caches``, when the group exists)."""

import pytest

from semshare_vllm.vllm_compat import tensor_parallel


def test_the_rank_comes_from_vllms_tensor_parallel_group(monkeypatch):
    from vllm.distributed import parallel_state

    monkeypatch.setattr(parallel_state, "_TP", None)
    with pytest.raises(AssertionError):
        tensor_parallel.tp_rank()

    class Group:
        rank_in_group = 1

    monkeypatch.setattr(parallel_state, "_TP", Group())
    assert tensor_parallel.tp_rank() == 1
