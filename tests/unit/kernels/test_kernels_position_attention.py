"""``attend_by_position`` (the recompute's attention off vLLM's CPU backend) against a plain
per-head reference: the torch version (SDPA, in chunks) and the Triton kernel, at scattered
positions, at every position and at one, with grouped KV heads. The kernel runs compiled on a
CUDA device when there is one (a lent GPU: ``TRITON_INTERPRET=0``), else under the interpreter
on CPU tensors (tests/conftest.py sets it)."""

import math
import os

import numpy as np
import pytest
import torch
from support.attention import causal_probs

from semshare_vllm.kernels import position_attention
from semshare_vllm.kernels.position_attention import (
    attend_by_position,
    attend_by_position_reference,
    attend_chunks,
)

ON_CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
DEVICE = "cuda" if ON_CUDA else "cpu"
N, HQ, HKV, D = 300, 6, 2, 16
SCALE = 1 / math.sqrt(D)


def _inputs(positions, n=N, hq=HQ, hkv=HKV, d=D, seed=0):
    g = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(n, hkv, d, generator=g) for _ in range(2))
    q = torch.randn(len(positions), hq, d, generator=g)
    return q, k, v, torch.as_tensor(positions)


def _plain(q, k, v, q_pos, scale):
    """[S, Hq, D] in fp64: each query head's softmax-weighted values up to its position."""
    vv = v.double().repeat_interleave(q.shape[1] // k.shape[1], dim=1).transpose(0, 1)
    return (causal_probs(q, k, q_pos, scale) @ vv).transpose(0, 1)


def _run(impl, q, k, v, q_pos, scale, dtype=torch.float32):
    q, k, v = (t.to(DEVICE, dtype) for t in (q, k, v))
    return attend_by_position(q, k, v, q_pos.to(DEVICE), scale, impl=impl).cpu()


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize(
    "positions",
    [np.arange(N), np.sort(np.random.default_rng(1).choice(N, 90, replace=False)), [7]],
    ids=["every", "scattered", "one"],
)
def test_attention_is_causal_by_position(positions, impl):
    q, k, v, q_pos = _inputs(positions)
    m = int(q_pos[-1]) + 1
    got = _run(impl, q, k[:m], v[:m], q_pos, SCALE)
    torch.testing.assert_close(got, _plain(q, k, v, q_pos, SCALE).float(), atol=1e-5, rtol=1e-5)


# Shapes the kernel's blocks meet: many query blocks and key blocks, queries on block edges,
# the last query before the end of the keys, head sizes that are not a power of two, no
# grouping and groups of 7 (Qwen2.5-7B's 28 / 4).
SHAPES = [
    # n, positions, Hq, Hkv, D
    (300, np.sort(np.random.default_rng(2).choice(300, 150, replace=False)), 6, 2, 64),
    (200, np.r_[0, 63, 64, 127, 128, 129, 191], 4, 4, 80),
    (260, np.r_[np.arange(5), np.arange(100, 230)], 28, 4, 128),
    (130, np.r_[129], 7, 1, 64),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n, positions, hq, hkv, d", SHAPES, ids=lambda x: "")
def test_the_kernel_matches_the_reference(n, positions, hq, hkv, d, dtype):
    q, k, v, q_pos = _inputs(positions, n, hq, hkv, d, seed=4)
    scale = 1 / math.sqrt(d)
    want = _plain(q.to(dtype), k.to(dtype), v.to(dtype), q_pos, scale)
    got = _run("triton", q, k, v, q_pos, scale, dtype)
    assert got.dtype == dtype and got.shape == q.shape
    # fp32: exact softmax up to summation order (this pins the mask: an off-by-one key moves
    # outputs by ~1e-2); 16-bit: the probabilities go to the tensor cores in the input's
    # precision (as in flash attention), about 1% of the output's scale
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


def test_the_kernel_reads_strided_heads_and_casts_the_cache_dtype():
    """Queries a view of [S, H + 1, D] (as vLLM's qkv split hands them), keys in the cache's
    dtype (fp16) under bf16 queries: the result in the queries' dtype."""
    positions = np.sort(np.random.default_rng(5).choice(N, 40, replace=False))
    q, k, v, q_pos = _inputs(positions, hq=HQ + 1, d=64, seed=6)
    q = q[:, 1:]
    got = attend_by_position(
        q.to(DEVICE, torch.bfloat16),
        k.to(DEVICE, torch.float16),
        v.to(DEVICE, torch.float16),
        q_pos.to(DEVICE),
        1 / 8,
        impl="triton",
    ).cpu()
    assert got.dtype == torch.bfloat16
    want = _plain(q.bfloat16(), k.half(), v.half(), q_pos, 1 / 8)
    torch.testing.assert_close(got.double(), want, atol=3e-2, rtol=3e-2)


def test_on_a_gpu_the_torch_version_chunks_only_to_bound_the_scores():
    """On CPU eight chunks (fewer for few queries); on CUDA as few calls as keep each call's
    scores (heads x rows x keys: what SDPA's math kernel makes where no fused one takes the
    mask) within ATTEND_SCORE_ELEMENTS; the rows of the largest chunk included."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert attend_chunks(851, 8192, 28, cpu) == 8 and attend_chunks(90, 300, 6, cpu) == 2
    assert attend_chunks(851, 8192, 28, cuda) == 1
    for queries, keys, heads in [(2489, 8192, 28), (9862, 32768, 28), (30651, 30652, 1)]:
        chunks = attend_chunks(queries, keys, heads, cuda)
        largest = max(queries * (i + 1) // chunks - queries * i // chunks for i in range(chunks))
        assert largest * keys * heads <= position_attention.ATTEND_SCORE_ELEMENTS
        assert (largest + 1) * keys * heads > position_attention.ATTEND_SCORE_ELEMENTS // 2
    assert attend_chunks(5, 1 << 30, 28, cuda) == 5  # one row a call at most, never fewer


@pytest.mark.parametrize("chunks", [1, 5, 90])
def test_the_reference_is_the_same_in_any_number_of_chunks(monkeypatch, chunks):
    """The count a GPU would take, run here on CPU tensors: the same result."""
    positions = np.sort(np.random.default_rng(3).choice(N, 90, replace=False))
    q, k, v, q_pos = _inputs(positions)
    want = attend_by_position_reference(q, k, v, q_pos, SCALE)
    monkeypatch.setattr(position_attention, "attend_chunks", lambda *a: chunks)
    got = attend_by_position_reference(q, k, v, q_pos, SCALE)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_auto_runs_the_kernel_on_cuda_only(monkeypatch):
    """CPU tensors: the torch version (masked SDPA), also where the interpreter is on; the
    queries at every position: the plain causal SDPA kernel, on any device, the kernel forced
    or not. The Triton kernel runs in neither case."""
    from semshare_vllm.kernels import triton_attention

    def no_kernel(*args):
        raise AssertionError("the Triton kernel ran")

    monkeypatch.setattr(triton_attention, "attend_by_position", no_kernel)
    ran = []
    real = position_attention._sdpa
    monkeypatch.setattr(
        position_attention,
        "_sdpa",
        lambda q, k, v, mask, scale: ran.append(mask is None) or real(q, k, v, mask, scale),
    )
    positions = np.sort(np.random.default_rng(7).choice(N, 30, replace=False))
    q, k, v, q_pos = _inputs(positions)
    attend_by_position(q, k, v, q_pos, SCALE)
    assert ran and not any(ran)  # masked calls only
    ran.clear()
    q_all, *_ = _inputs(np.arange(N))
    attend_by_position(q_all, k, v, torch.arange(N), SCALE, impl="triton")
    assert ran == [True]  # one causal call


def test_shapes_the_kernel_does_not_fit_fall_back_to_torch_once(monkeypatch, caplog):
    """A GPU with less shared memory than the kernel's tiles take (Triton raises OutOfResources
    at launch): the torch version answers, the same, and the kernel is not tried again for
    that shape (logged once)."""
    from triton.runtime.errors import OutOfResources

    from semshare_vllm.kernels import triton_attention

    tries = []

    def too_big(*args):
        tries.append(1)
        raise OutOfResources(232448, 101376, "shared memory")

    monkeypatch.setattr(triton_attention, "attend_by_position", too_big)
    monkeypatch.setattr(position_attention, "_TOO_BIG", set())
    positions = np.sort(np.random.default_rng(8).choice(N, 40, replace=False))
    q, k, v, q_pos = _inputs(positions)
    want = attend_by_position_reference(q, k, v, q_pos, SCALE)
    for _ in range(2):
        got = attend_by_position(q, k, v, q_pos, SCALE, impl="triton")
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert len(tries) == 1
    assert sum("does not fit" in r.getMessage() for r in caplog.records) == 1
