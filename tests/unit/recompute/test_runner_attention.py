"""The layer runner's own attention math against a plain per-head reference: ``attend`` (torch
SDPA over gathered K/V, any backend) at scattered and at every position, and
``tail_attention`` (the attention mass the last tokens pay each position), with grouped KV
heads."""

import math

import numpy as np
import pytest
import torch

from semshare_vllm.recompute import layer_runner
from semshare_vllm.recompute.layer_runner import attend, attend_chunks, tail_attention

N, HQ, HKV, D = 300, 6, 2, 16
# on a lent GPU also there (its own chunk count, other SDPA kernels)
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
SCALE = 1 / math.sqrt(D)


def _inputs(positions):
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(N, HKV, D, generator=g) for _ in range(2))
    q = torch.randn(len(positions), HQ, D, generator=g)
    return q, k, v, torch.as_tensor(positions)


def _probs(q, k, q_pos):
    """[Hq, t, N]: each query head's softmax over the keys up to its query's position."""
    kk = k.repeat_interleave(HQ // HKV, dim=1).transpose(0, 1)  # [Hq, N, D]
    scores = q.transpose(0, 1) @ kk.transpose(1, 2) * SCALE
    seen = torch.arange(N)[None, :] <= q_pos[:, None]
    return torch.softmax(scores.masked_fill(~seen, float("-inf")), dim=-1)


@pytest.mark.parametrize(
    "positions",
    [np.arange(N), np.sort(np.random.default_rng(1).choice(N, 90, replace=False)), [7]],
    ids=["every", "scattered", "one"],
)
@pytest.mark.parametrize("device", DEVICES)
def test_attend_is_causal_attention_by_position(positions, device):
    q, k, v, q_pos = _inputs(positions)
    vv = v.repeat_interleave(HQ // HKV, dim=1).transpose(0, 1)
    want = (_probs(q, k, q_pos) @ vv).transpose(0, 1)
    q, k, v, q_pos = (t.to(device) for t in (q, k, v, q_pos))
    got = attend(q, k[: int(q_pos[-1]) + 1], v[: int(q_pos[-1]) + 1], q_pos, SCALE)
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)


def test_on_a_gpu_attend_chunks_only_to_bound_the_mask():
    """On CPU eight chunks (fewer for few queries); on CUDA one masked call, as many as keep
    each call's mask within ATTEND_MASK_ELEMENTS (the shapes measured on an H200)."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert attend_chunks(851, 8192, cpu) == 8 and attend_chunks(90, 300, cpu) == 2
    assert attend_chunks(851, 8192, cuda) == 1 and attend_chunks(2489, 8192, cuda) == 1
    assert attend_chunks(3308, 32768, cuda) == 2 and attend_chunks(9862, 32768, cuda) == 5
    assert attend_chunks(1, 1 << 30, cuda) == 1  # never more chunks than queries


@pytest.mark.parametrize("chunks", [1, 5, 90])
def test_attend_is_the_same_in_any_number_of_chunks(monkeypatch, chunks):
    """The count a GPU would take, run here on CPU tensors: the same result."""
    positions = np.sort(np.random.default_rng(3).choice(N, 90, replace=False))
    q, k, v, q_pos = _inputs(positions)
    want = attend(q, k, v, q_pos, SCALE)
    monkeypatch.setattr(layer_runner, "attend_chunks", lambda *a: chunks)
    torch.testing.assert_close(attend(q, k, v, q_pos, SCALE), want, atol=1e-6, rtol=1e-6)


def test_tail_attention_sums_the_last_queries_attention_per_key():
    positions = np.sort(np.random.default_rng(2).choice(N, 60, replace=False))
    q, k, _, q_pos = _inputs(positions)
    first = int(positions[-12])  # the last 12 queries are the window's
    want = _probs(q, k, q_pos)[:, q_pos >= first].sum((0, 1))
    got = tail_attention(q, k, q_pos, first, SCALE)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert got.shape == (N,) and math.isclose(float(got.sum()), HQ * 12, rel_tol=1e-5)
    assert float(got[int(q_pos[-1]) + 1 :].abs().sum()) == 0.0  # no key after the last query
    assert torch.equal(tail_attention(q, k, q_pos, N, SCALE), torch.zeros(N))  # none in it
