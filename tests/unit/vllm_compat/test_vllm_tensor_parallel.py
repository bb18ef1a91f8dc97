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


def test_one_rank_agrees_with_itself_without_a_collective(monkeypatch):
    """No group (tools, tests) or a group of one: the input comes back, nothing is sent. (Two
    ranks: tests/unit/worker/test_worker_tensor_parallel.py.)"""
    import torch
    from vllm.distributed import parallel_state

    def no_collective(*args, **kwargs):
        raise AssertionError("a collective with one rank")

    monkeypatch.setattr(torch.distributed, "all_reduce", no_collective)
    scores = torch.tensor([0.5, 2.0], dtype=torch.float64)
    for tp in (None, type("Group", (), {"world_size": 1, "cpu_group": object()})()):
        monkeypatch.setattr(parallel_state, "_TP", tp)
        monkeypatch.setattr(parallel_state, "_PP", tp)
        assert tensor_parallel.all_agree(False) is False
        assert tensor_parallel.all_agree(True) is True
        out = tensor_parallel.all_reduce_scores(scores)
        assert out.dtype == torch.float32 and out.tolist() == [0.5, 2.0]
