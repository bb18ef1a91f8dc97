"""The layer runner's own attention math against a plain per-head reference: ``tail_attention``
(the attention mass the last tokens pay each position), with grouped KV heads. (The attention
itself: tests/unit/kernels/test_kernels_position_attention.py.)"""

import math

import numpy as np
import torch
from support.attention import causal_probs

from semshare_vllm.recompute.layer_runner import tail_attention

N, HQ, HKV, D = 300, 6, 2, 16
SCALE = 1 / math.sqrt(D)


def _inputs(positions):
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(N, HKV, D, generator=g) for _ in range(2))
    q = torch.randn(len(positions), HQ, D, generator=g)
    return q, k, v, torch.as_tensor(positions)


def test_tail_attention_sums_the_last_queries_attention_per_key():
    positions = np.sort(np.random.default_rng(2).choice(N, 60, replace=False))
    q, k, _, q_pos = _inputs(positions)
    first = int(positions[-12])  # the last 12 queries are the window's
    want = causal_probs(q, k, q_pos, SCALE)[:, q_pos >= first].sum((0, 1)).float()
    got = tail_attention(q, k, q_pos, first, SCALE)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert got.shape == (N,) and math.isclose(float(got.sum()), HQ * 12, rel_tol=1e-5)
    assert float(got[int(q_pos[-1]) + 1 :].abs().sum()) == 0.0  # no key after the last query
    assert torch.equal(tail_attention(q, k, q_pos, N, SCALE), torch.zeros(N))  # none in it
