"""The Triton kernels against their torch references: compiled on a CUDA device when there is
one (a lent GPU: ``TRITON_INTERPRET=0``, tables from ``testbed.rope_tables``), else run by the
Triton interpreter on CPU tensors. Either way bit-exact in fp32, within one rounding step in
bf16 / fp16 (the interpreter truncates fp32 -> bf16 where torch and GPUs round to nearest even).

TRITON_INTERPRET is read when ``@triton.jit`` decorates, so it cannot be switched on inside a
running process that lacks it: there this file re-runs itself in a subprocess with it set.
(tests/conftest.py sets it by default, so a plain pytest run takes the direct path.)
"""

import os
import subprocess
import sys

import pytest
import torch

# On a CUDA machine (a lent GPU) the kernels run compiled, on the device, and TRITON_INTERPRET
# must be 0 there; elsewhere they run under the interpreter on CPU tensors.
ON_CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
DEVICE = "cuda" if ON_CUDA else "cpu"

if not ON_CUDA and os.environ.get("TRITON_INTERPRET") != "1":

    def test_triton_kernels_under_interpreter():
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", __file__],
            env={**os.environ, "TRITON_INTERPRET": "1"},
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 0, proc.stdout[-20000:] + proc.stderr[-5000:]

else:
    from support.gpu_layouts import CASE_IDS as GPU_CASE_IDS
    from support.gpu_layouts import CASES as GPU_CASES
    from support.gpu_layouts import fill, vllm_kv_caches

    from semshare_vllm.kernels import triton_gather
    from semshare_vllm.kernels.gather_rearrange import (
        gather_rearrange,
        gather_rearrange_reference,
    )
    from semshare_vllm.kernels.rope import correct_rope, rope_correct_reference
    from semshare_vllm.layout.specs import CpuAttnSpec, page_spec

    TABLES = ["neox", "gptj", "partial", "partial_gptj", "yarn", "neox_head80"]

    @pytest.fixture(scope="module")
    def tables():
        from semshare_vllm.testbed import rope_tables

        return {name: t.to(DEVICE) for name, t in rope_tables.tables(TABLES).items()}

    def steps_apart(a: torch.Tensor, b: torch.Tensor) -> int:
        """Largest distance between a and b in representable values of their 16-bit dtype."""

        def ordered(x):
            bits = x.view(torch.int16).int()
            return torch.where(bits < 0, -(bits & 0x7FFF), bits)

        return int((ordered(a) - ordered(b)).abs().max())

    def assert_matches(got: torch.Tensor, want: torch.Tensor):
        assert got.dtype == want.dtype
        if got.dtype == torch.float32:
            assert torch.equal(got, want)
        else:
            assert steps_apart(got, want) <= 1

    def positions(count, limit, seed):
        g = torch.Generator().manual_seed(seed)
        src = torch.randint(0, limit, (count,), generator=g)
        dst = torch.randint(0, limit, (count,), generator=g)
        dst[::4] = src[::4]
        return src.to(DEVICE), dst.to(DEVICE)

    @pytest.mark.parametrize("name", sorted(TABLES))
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
    def test_rope_kernel_matches_reference(tables, name, dtype):
        table = tables[name]
        g = torch.Generator().manual_seed(1)
        # a strided view: heads of a [T, H + 1, D] buffer
        k = torch.randn(70, 4, table.head_size, generator=g).to(DEVICE, dtype)[:, 1:]
        src, dst = positions(70, table.max_position, seed=2)
        want = rope_correct_reference(k, src, dst, table)
        got = correct_rope(k, src, dst, table, impl="triton")
        assert_matches(got, want)
        assert torch.equal(got[::4], k[::4])  # p == q: untouched, bit for bit
        in_place = k.clone()
        correct_rope(in_place, src, dst, table, out=in_place, impl="triton")
        assert torch.equal(in_place, got)

    @pytest.fixture
    def launches(monkeypatch):
        """The layer stacks of each kernel launch (one launch per stack)."""
        seen = []
        stack = triton_gather.stack_layers
        monkeypatch.setattr(
            triton_gather, "stack_layers", lambda caches: seen.append(stack(caches)) or seen[-1]
        )
        return seen

    L, B, H, N = 3, 8, 2, 16
    T_SRC, M = 50, 45

    def caches_for(kind, arrangement, dtype, head):
        size = B * H * N * 2 * head
        if arrangement == "uniform":
            flat = torch.zeros(L * size, dtype=dtype, device=DEVICE)
            storages = [flat[i * size : (i + 1) * size] for i in range(L)]
        else:
            storages = [torch.zeros(size, dtype=dtype, device=DEVICE) for _ in range(L)]
        if kind == "packed_token_major":
            caches = [s.view(B, N, H, 2 * head).permute(0, 2, 1, 3) for s in storages]
        else:
            caches = [s.view(B, H, N, 2 * head) for s in storages]
        if kind.startswith("packed"):
            return caches, page_spec("FLASH_ATTN", head).offsets(caches[0]).to(DEVICE)
        if kind == "cpu_vec":
            return caches, page_spec("CPU_ATTN", head, "vec").offsets(caches[0]).to(DEVICE)
        g = torch.Generator().manual_seed(7)
        k_pos = torch.randperm(N * head, generator=g).view(N, head)
        v_pos = torch.randperm(N * head, generator=g).view(N, head)
        spec = CpuAttnSpec("CPU_ATTN", head, positions=(k_pos, v_pos))
        return caches, spec.offsets(caches[0]).to(DEVICE)

    # cpu_vec pages are calibrated with vLLM's CPU ops: not on a GPU machine (cpu_permuted
    # exercises the same table offsets there).
    KINDS = [
        ("packed", "uniform"),
        ("packed_token_major", "separate"),
        ("cpu_permuted", "separate"),
    ] + ([] if ON_CUDA else [("cpu_vec", "uniform")])

    @pytest.mark.parametrize("kind, arrangement", KINDS)
    @pytest.mark.parametrize(
        "src_dtype, cache_dtype",
        [
            (torch.float32, torch.float32),
            (torch.bfloat16, torch.bfloat16),
            (torch.float32, torch.bfloat16),
            (torch.float16, torch.float16),
        ],
    )
    @pytest.mark.parametrize(
        "rope", [None, "neox", "partial", "partial_gptj", "yarn", "neox_head80"]
    )
    def test_gather_kernel_matches_reference(
        tables, launches, kind, arrangement, src_dtype, cache_dtype, rope
    ):
        table = tables[rope] if rope else None
        head = table.head_size if table else 64
        g = torch.Generator().manual_seed(3)
        src = torch.randn(T_SRC, L, H, 2 * head, generator=g).to(DEVICE, src_dtype).transpose(0, 1)
        rows = torch.randint(0, T_SRC, (M,), generator=g)
        rows[1] = rows[0]
        slots = torch.randperm(B * N, generator=g)[:M]
        rows, slots = rows.to(DEVICE), slots.to(DEVICE)
        src_pos, dst_pos = positions(M, table.max_position if table else 1, seed=4)
        want, offsets = caches_for(kind, arrangement, cache_dtype, head)
        got, _ = caches_for(kind, arrangement, cache_dtype, head)
        gather_rearrange_reference(src, rows, slots, want, offsets, table, src_pos, dst_pos)
        gather_rearrange(src, rows, slots, got, offsets, table, src_pos, dst_pos, impl="triton")
        for w, g_ in zip(want, got):
            assert_matches(g_, w)
        assert any(bool(w.abs().sum() > 0) for w in want)
        assert len(launches[0]) == (1 if arrangement == "uniform" else L)

    @pytest.mark.parametrize("rope", [None, "neox"])
    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
    @pytest.mark.parametrize("backend, layout", GPU_CASES, ids=GPU_CASE_IDS)
    def test_gather_kernel_into_vllm_033_layer_views(
        tables, launches, backend, layout, dtype, rope
    ):
        """Into the per-layer views CUDA vLLM 0.33 registers (every layout of every backend, all
        layers over one buffer: ``support.gpu_layouts``), the kernel writes what the reference
        does, in one launch for all layers. On a lent GPU the buffer is on the device and the
        kernel runs compiled, as under CUDA vLLM."""
        table = tables[rope] if rope else None
        head = table.head_size if table else 64
        names = [f"model.layers.{i}.self_attn.attn" for i in range(L)]

        def caches():
            views = list(vllm_kv_caches(layout, names, B, H, N, head, dtype, DEVICE).values())
            fill(views, seed=5)
            return views

        g = torch.Generator().manual_seed(6)
        src = torch.randn(T_SRC, L, H, 2 * head, generator=g).to(DEVICE, dtype).transpose(0, 1)
        rows = torch.randint(0, T_SRC, (M,), generator=g).to(DEVICE)
        slots = torch.randperm(B * N, generator=g)[:M].to(DEVICE)
        src_pos, dst_pos = positions(M, table.max_position if table else 1, seed=8)
        want, got, before = caches(), caches(), caches()
        offsets = page_spec(backend, head).offsets(want[0]).to(DEVICE)
        gather_rearrange_reference(src, rows, slots, want, offsets, table, src_pos, dst_pos)
        gather_rearrange(src, rows, slots, got, offsets, table, src_pos, dst_pos, impl="triton")
        for w, g_, b in zip(want, got, before):
            assert_matches(g_, w)
            assert not torch.equal(w, b)
        assert len(launches) == 1 and len(launches[0]) == 1

    # Run in its own process: a wrong address there is a crash (a segfault under the
    # interpreter, an illegal access poisoning the CUDA context), not a failed assert.
    _FAR_HEADS = """
import sys, torch
from semshare_vllm.kernels.gather_rearrange import gather_rearrange
from semshare_vllm.layout.specs import page_spec

device, heads, n, d = sys.argv[1], 3, 16, 64
blocks = (1 << 30) // (n * 2 * d) + 1  # head stride just past 2**30 elements
try:  # ~6.4 GB, never touched but for the pages written: lazily mapped on CPU
    raw = torch.empty(heads * blocks * n * 2 * d, dtype=torch.float16, device=device)
except (RuntimeError, MemoryError) as exc:
    print("SKIP", exc)
    sys.exit(0)
cache = raw.view(heads, blocks, n, 2 * d).permute(1, 0, 2, 3)  # LHBNC: [B, H, N, C] of [H, B, N, C]
assert (heads - 1) * cache.stride(1) >= 2**31 > cache.stride(1)
g = torch.Generator().manual_seed(0)
src = torch.randn(1, 5, heads, 2 * d, generator=g).half().to(device)
slots = torch.tensor([0, 17, 5000, (blocks - 1) * n, (blocks - 1) * n + 3], device=device)
offsets = page_spec("FLASH_ATTN", d).offsets(cache)
gather_rearrange(src, torch.arange(5, device=device), slots, [cache], offsets, impl="triton")
for m, s in enumerate(slots.tolist()):
    assert torch.equal(cache[s // n, :, s % n], src[0, m]), (m, s)
print("OK")
"""

    def test_gather_kernel_addresses_heads_past_int32():
        """vLLM 0.33's LHBNC layout (``VLLM_KV_CACHE_LAYOUT=LHBNC``, which FLASH_ATTN and
        TRITON_ATTN accept) puts each head's pages of a layer in one run, so the head stride is
        B * N * C elements: on a large cache, head h's offset passes 2**31 while the stride
        itself fits an int32. The kernel must address it in 64 bits."""
        proc = subprocess.run(
            [sys.executable, "-c", _FAR_HEADS, DEVICE],
            env={**os.environ, "TRITON_INTERPRET": "0" if ON_CUDA else "1"},
            capture_output=True,
            text=True,
            timeout=600,
        )
        if proc.stdout.startswith("SKIP"):
            pytest.skip(f"no room for a 6.4 GB cache here: {proc.stdout}")
        assert proc.returncode == 0 and proc.stdout.strip() == "OK", (
            f"rc={proc.returncode}\n{proc.stdout[-5000:]}\n{proc.stderr[-5000:]}"
        )
