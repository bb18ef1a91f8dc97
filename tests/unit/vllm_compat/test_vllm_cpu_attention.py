"""``vllm_compat.cpu_attention``: K/V written with vLLM's CPU cache-write op and attended with
its kernels over a request's scattered blocks give plain causal attention, for queries at the
context's last positions (a prefill) and at scattered ones (runs and single positions)."""

import math

import numpy as np
import pytest
import torch

from semshare_vllm.vllm_compat.cpu_attention import causal_attention, write_kv

B, HQ, H, N, D = 6, 4, 2, 32, 32
CONTEXT = 100
POSITIONS = {
    "prefill": np.arange(CONTEXT - 7, CONTEXT),
    "scattered": np.array([0, 3, 4, 5, 31, 32, 33, 34, 35, 40, 64, 90, 99]),
    "one early": np.array([17]),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", list(POSITIONS))
def test_written_kv_attended_by_vllms_kernels_is_causal_attention(dtype, shape):
    block_ids = [5, 2, 4, 0]
    positions = POSITIONS[shape]
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(CONTEXT, H, D, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(len(positions), HQ, D, generator=g).to(dtype)
    cache = torch.zeros(B, H, N, 2 * D, dtype=dtype)
    pos = torch.arange(CONTEXT)
    slots = torch.tensor(block_ids)[pos // N] * N + pos % N
    write_kv(cache, k, v, slots, "vec")
    scale = 1 / math.sqrt(D)
    out = causal_attention(cache, q, positions, block_ids, scale, "vec")
    # reference: the query at position p sees keys 0..p
    kk, vv = (x.float().repeat_interleave(HQ // H, dim=1).transpose(0, 1) for x in (k, v))
    scores = q.float().transpose(0, 1) @ kk.transpose(1, 2) * scale  # [HQ, t, context]
    mask = pos[None, :] <= torch.as_tensor(positions)[:, None]
    ref = (torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ vv).transpose(0, 1)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
