"""``vllm_compat.cpu_attention``: K/V written with vLLM's CPU cache-write op and attended with
its prefill kernels over a request's scattered blocks give plain causal attention."""

import math

import pytest
import torch

from semshare_vllm.vllm_compat.cpu_attention import prefill_attention, write_kv

B, HQ, H, N, D = 6, 4, 2, 32, 32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_written_kv_attended_by_vllms_kernels_is_causal_attention(dtype):
    block_ids, context, t = [5, 2, 4, 0], 100, 7
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(context, H, D, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(t, HQ, D, generator=g).to(dtype)
    cache = torch.zeros(B, H, N, 2 * D, dtype=dtype)
    pos = torch.arange(context)
    slots = torch.tensor(block_ids)[pos // N] * N + pos % N
    write_kv(cache, k, v, slots, "vec")
    scale = 1 / math.sqrt(D)
    out = prefill_attention(cache, q, block_ids, context, scale, "vec")
    # reference: query i sits at position context - t + i and sees keys 0..its position
    kk, vv = (x.float().repeat_interleave(HQ // H, dim=1).transpose(0, 1) for x in (k, v))
    scores = q.float().transpose(0, 1) @ kk.transpose(1, 2) * scale  # [HQ, t, context]
    mask = pos[None, :] <= (context - t + torch.arange(t))[:, None]
    ref = (torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ vv).transpose(0, 1)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
