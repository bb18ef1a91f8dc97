"""The worker's KV moves and the recompute over vLLM 0.33's GPU KV layouts, on CPU tensors with
the real shapes and strides (FLASH_ATTN, TRITON_ATTN, FLASHINFER, every layout each runs with,
fp16 and bf16; ``support/gpu_layouts.py``), each against a reference computed with plain torch
indexing on a contiguous copy of the same caches:

* capture (paged cache -> host pool) and exact-prefix loads (pool or a donor still in its own
  blocks -> a request's blocks, block-aligned and not);
* semantic loads (staged donor rows, K RoPE-corrected, scattered), by the torch path and by the
  Triton kernel (``TRITON_INTERPRET=1``), from the pool and from the donor's own blocks;
* the selective recompute's reads and writes of the paged cache (``LayerRunner``), and a
  semantic load repaired through the worker, against the same run on contiguous caches.
"""

import importlib
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from support.gpu_layouts import CASE_IDS, CASES, fill, vllm_kv_caches
from support.worker import geometry, make_worker

from semshare_vllm.config import SemShareConfig
from semshare_vllm.core.keys import DonorKey
from semshare_vllm.kernels import RopeTable, rope_correct_reference
from semshare_vllm.layout.specs import page_spec
from semshare_vllm.metadata import CaptureSpec, LoadSpec, SemShareConnectorMetadata
from semshare_vllm.recompute.layer_runner import LayerRunner
from semshare_vllm.recompute.policy import CacheBlend
from semshare_vllm.store.host_store import HostKVStore
from semshare_vllm.worker import loads as worker_loads
from semshare_vllm.worker import setup
from semshare_vllm.worker.repair import Repairer

LAYERS = tuple(f"model.layers.{i}.self_attn.attn" for i in range(3))
B, H, N, D = 14, 2, 16, 64
DTYPES = [torch.float16, torch.bfloat16]
CASE = pytest.mark.parametrize("backend, layout", CASES, ids=CASE_IDS)
DTYPE = pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])


# ---- set-up and the plain reference ------------------------------------------------------------
def plain_copy(cache: torch.Tensor) -> torch.Tensor:
    """A contiguous copy (``.contiguous()`` would return an already contiguous view itself)."""
    return cache.clone(memory_format=torch.contiguous_format)


def registered(monkeypatch, backend, layout, dtype, config=None, plain=False):
    """A worker registered with 0.33's per-layer views of one buffer holding random KV (with
    ``plain``, with contiguous per-layer copies of them instead), a real host pool; and a plain
    copy of the caches for the reference."""
    caches = vllm_kv_caches(layout, LAYERS, B, H, N, D, dtype)
    fill(caches.values())
    if plain:
        caches = {name: plain_copy(cache) for name, cache in caches.items()}
    geom = geometry(layer_names=LAYERS, block_size=N, num_kv_heads=H, head_size=D, dtype=dtype)
    w = make_worker(monkeypatch, geom=geom, config=config, bound=caches, backend=backend)

    def host_store(config, geometry, layout, cache, rank):
        shape = tuple(cache.shape[1:])
        return HostKVStore(
            1 << 20, list(LAYERS), shape, cache.dtype, layout.name, page_layout=layout
        )

    monkeypatch.setattr(setup, "make_store", host_store)
    w.register_kv_caches(caches)
    assert w.disabled is None
    assert [c.data_ptr() for c in w.kv.caches] == [caches[n].data_ptr() for n in LAYERS]
    return w, [plain_copy(c) for c in w.kv.caches]


def where(block_ids, positions):
    """(blocks, in-block offsets) of a request's token positions."""
    pos = torch.as_tensor(positions, dtype=torch.long)
    return torch.as_tensor(block_ids)[pos // N], pos % N


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int16)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def steps_apart(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance between a and b in representable values of their 16-bit dtype."""

    def ordered(x):
        i = bits(x).int()
        return torch.where(i < 0, -(i & 0x7FFF), i)

    return int((ordered(a) - ordered(b)).abs().max())


def capture(w, key, block_ids, num_tokens, req="a"):
    spec = CaptureSpec(req, key, list(range(num_tokens)), block_ids)
    w.start_load_kv(SemShareConnectorMetadata(captures=[spec]))
    w.start_captures()
    w.flush_captures()
    assert w.get_finished({req}) == ({req}, None)
    assert key in w.kv.store and w.captures.held(key) is None


def rope_table(max_pos=128):
    """A neox rotation over the whole head (vLLM-derived tables: tests/unit/kernels)."""
    half = D // 2
    inv_freq = 1.0 / 10000 ** (torch.arange(half, dtype=torch.float) / half)
    angles = torch.arange(max_pos, dtype=torch.float)[:, None] * inv_freq
    return RopeTable(torch.cat((angles.cos(), angles.sin()), dim=1), D, D, is_neox=True)


# ---- capture and exact loads -------------------------------------------------------------------
@DTYPE
@CASE
def test_capture_then_exact_loads(monkeypatch, backend, layout, dtype):
    w, ref = registered(monkeypatch, backend, layout, dtype)
    key = DonorKey("", "d")
    donor_blocks = [5, 2, 7]
    capture(w, key, donor_blocks, 40)
    pool, pool_blocks = w.kv.store.pool, w.kv.store.blocks(key)
    for layer in range(len(LAYERS)):  # the pool holds the donor's pages, byte for byte
        for i, b in enumerate(donor_blocks):
            assert same_bits(pool[layer, pool_blocks[i]], ref[layer][b])

    # From the pool: block-aligned (whole pages, then a partial block), then at other offsets;
    # from the donor's own blocks while its capture is still pending.
    other = DonorKey("", "e")
    w.start_load_kv(
        SemShareConnectorMetadata(captures=[CaptureSpec("e", other, list(range(20)), [1, 6])])
    )
    assert w.captures.held(other) is not None
    loads = [
        (LoadSpec("b", key, 0, 0, 40, [3, 4, 9]), donor_blocks),
        (LoadSpec("c", key, 5, 21, 30, [8, 10, 11, 0]), donor_blocks),
        (LoadSpec("f", other, 3, 7, 15, [12, 13]), [1, 6]),
    ]
    w.start_load_kv(SemShareConnectorMetadata(loads=[spec for spec, _ in loads]))
    assert w.get_block_ids_with_load_errors() == set()
    assert w.stats.totals["loaded_tokens"] == 85 and w.stats.totals["block_copied_tokens"] == 15
    for spec, src_blocks in loads:  # the reference: the same token moves, by plain indexing
        sb, sn = where(src_blocks, range(spec.src_start, spec.src_start + spec.num_tokens))
        db, dn = where(spec.block_ids, range(spec.dst_start, spec.dst_start + spec.num_tokens))
        for r in ref:
            r[db, :, dn] = r[sb, :, sn]
    for cache, r in zip(w.kv.caches, ref):
        assert same_bits(cache, r)
    w.flush_captures()
    w.shutdown()


# ---- semantic loads ----------------------------------------------------------------------------
DST_START, NUM = 16, 40
# Target position DST_START + i takes donor position DONOR_POS[i]: a shifted run, unaligned (-1)
# holes, a run at its own positions (no rotation), a reordered run, a repeated row.
DONOR_POS = (
    list(range(20, 32))
    + [-1, -1]
    + list(range(30, 40))
    + list(range(0, 10))
    + [3, 3, -1]
    + list(range(12, 15))
)
assert len(DONOR_POS) == NUM


def semantic_reference(ref, donor_blocks, block_ids, table):
    """The semantic load done on the plain copy: each aligned target position takes its donor
    row, K rotated from the donor's position to its own, V as is."""
    i = np.flatnonzero(np.asarray(DONOR_POS) >= 0)
    src = torch.as_tensor(np.asarray(DONOR_POS)[i])
    dst = torch.as_tensor(DST_START + i)
    sb, sn = where(donor_blocks, src)
    db, dn = where(block_ids, dst)
    for r in ref:
        rows = r[sb, :, sn]  # [M, H, 2D], read before any write
        rows[..., :D] = rope_correct_reference(rows[..., :D], src, dst, table)
        r[db, :, dn] = rows


@pytest.mark.parametrize("source", ["pool", "own_blocks"])
@pytest.mark.parametrize("impl", ["pages", "torch", "triton"])
@DTYPE
@CASE
def test_semantic_load(monkeypatch, backend, layout, dtype, impl, source):
    """``pages``: the CPU path (whole pages through the layout, ``kernels.page_move``);
    ``torch`` / ``triton``: the CUDA path (``gather_rearrange``), its torch reference or its
    Triton kernel."""
    if impl == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernel on CPU tensors needs TRITON_INTERPRET=1 (tests/conftest)")
    w, ref = registered(monkeypatch, backend, layout, dtype)
    launches = []
    if impl != "pages":  # the worker moves CPU tensors by pages: make it take the CUDA path
        monkeypatch.setattr(worker_loads, "moves_by_pages", lambda cache: False)
    if impl == "triton":  # the dispatcher sends CPU tensors to torch: send them to Triton
        from semshare_vllm.kernels import triton_gather

        kernel = triton_gather.gather_rearrange_triton
        # (the module, not the function of the same name that kernels/__init__ exports)
        gather_module = importlib.import_module("semshare_vllm.kernels.gather_rearrange")
        monkeypatch.setattr(gather_module, "use_triton", lambda t, impl="auto": True)
        monkeypatch.setattr(
            triton_gather,
            "gather_rearrange_triton",
            lambda *a: launches.append(a[3]) or kernel(*a),
        )
    table = rope_table()
    w.kv.repairer = Repairer(None, table, w.kv.layout.offsets(w.kv.caches[0]))
    key, donor_blocks = DonorKey("", "d"), [5, 2, 7]
    if source == "pool":
        capture(w, key, donor_blocks, 40)
    else:  # still in its own blocks: staged through the cache's offsets, not the pool's
        spec = CaptureSpec("a", key, list(range(40)), donor_blocks)
        w.start_load_kv(SemShareConnectorMetadata(captures=[spec]))
        assert w.captures.held(key) is not None
    block_ids = [0, 3, 9, 10]  # positions [0, 16) are the request's own prefix
    spec = LoadSpec("b", key, 0, DST_START, NUM, block_ids, donor_pos=DONOR_POS)
    w.start_load_kv(SemShareConnectorMetadata(loads=[spec]))
    assert w.get_block_ids_with_load_errors() == set() and not w.report.bad_donors
    assert w.stats.totals["loaded_tokens"] == NUM
    assert bool(launches) == (impl == "triton")
    semantic_reference(ref, donor_blocks, block_ids, table)
    for cache, r in zip(w.kv.caches, ref):
        if impl != "triton":
            assert same_bits(cache, r)
        else:  # V moved as is; K rotated in fp32 and cast (the interpreter truncates to bf16)
            assert same_bits(cache[..., D:], r[..., D:])
            assert steps_apart(cache[..., :D], r[..., :D]) <= 1
    w.flush_captures()
    w.shutdown()


# ---- the recompute's view of the paged cache ---------------------------------------------------
HIDDEN, Q_HEADS = 64, 4


def vllm_attention(i):
    """vLLM's ``Attention`` with the attributes the recompute reads (its constructor needs a
    whole engine config)."""
    from vllm.model_executor.layers.attention.attention import Attention

    attn = Attention.__new__(Attention)
    torch.nn.Module.__init__(attn)
    attn.layer_name = LAYERS[i]
    attn.num_heads, attn.num_kv_heads, attn.head_size = Q_HEADS, H, D
    attn.sliding_window, attn.has_sink = None, False
    attn.impl = SimpleNamespace(scale=D**-0.5, logits_soft_cap=None)
    return attn


def rms(x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class SelfAttn(torch.nn.Module):
    def __init__(self, i):
        super().__init__()
        self.qkv_proj = torch.nn.Linear(HIDDEN, (Q_HEADS + 2 * H) * D, bias=False)
        self.o_proj = torch.nn.Linear(Q_HEADS * D, HIDDEN, bias=False)
        self.attn = vllm_attention(i)

    def forward(self, positions, hidden):
        q, k, v = self.qkv_proj(hidden).split([Q_HEADS * D, H * D, H * D], dim=-1)
        return self.o_proj(self.attn(q, k, v))


class Layer(torch.nn.Module):
    """A decoder layer called as vLLM's: (positions, hidden, residual) -> (hidden, residual)."""

    def __init__(self, i):
        super().__init__()
        self.self_attn = SelfAttn(i)
        self.mlp = torch.nn.Linear(HIDDEN, HIDDEN)

    def forward(self, positions, hidden, residual):
        residual = hidden if residual is None else hidden + residual
        hidden = self.self_attn(positions, rms(residual))
        return torch.tanh(self.mlp(hidden)), residual + hidden


class Inner(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(Layer(i) for i in range(len(LAYERS)))
        self.embedding = torch.nn.Embedding(100, HIDDEN)

    def embed_input_ids(self, ids):
        return self.embedding(ids)

    def norm(self, hidden, residual):
        out = rms(hidden + residual)
        return out, out


class LlamaForCausalLM(torch.nn.Module):
    """A tiny model of the structure the runner drives (``vllm_compat.decoder_layers``)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.model = Inner()


TOKENS = [int(t) for t in torch.randint(0, 100, (60,), generator=torch.Generator().manual_seed(5))]


@DTYPE
@CASE
def test_the_recompute_reads_and_writes_the_cache_as_on_a_plain_copy(backend, layout, dtype):
    """The layer runner over 0.33's views and over a contiguous copy of them: the same cache
    bytes after, the same hidden states and measured deviations; and the K/V it writes for
    layer 0 are the model's own projections, where plain indexing finds them."""
    model = LlamaForCausalLM()
    views = vllm_kv_caches(layout, LAYERS, B, H, N, D, dtype)
    fill(views.values())
    plain = {name: plain_copy(cache) for name, cache in views.items()}
    spec = page_spec(backend, D)
    block_ids = [4, 1, 8, 11]
    loaded = np.arange(10, 60)
    results = []
    for caches in (views, plain):
        runner = LayerRunner(model, caches, spec)
        selection = CacheBlend(loaded, always=np.array([10, 59]), ratio=0.3, check_layer=1)
        result = runner.recompute(TOKENS, block_ids, selection, context=60, final_hidden=True)
        results.append((result, selection.measured))
    (got, got_dev), (want, want_dev) = results
    assert got.per_layer == want.per_layer and got.per_layer[0] == 50 > got.per_layer[-1]
    # each layer timed; the whole-layer part is the layers that ran all 50 positions
    assert len(got.per_layer_ms) == len(got.per_layer) and min(got.per_layer_ms) > 0
    whole = [ms for n, ms in zip(got.per_layer, got.per_layer_ms) if n == 50]
    assert got.whole_layers_ms == pytest.approx(sum(whole)) and len(whole) < len(got.per_layer)
    assert np.array_equal(got.positions, want.positions)
    assert torch.equal(got.hidden, want.hidden) and got_dev == want_dev
    for name in LAYERS:
        assert same_bits(views[name], plain[name])
    attn = model.model.layers[0].self_attn
    with torch.no_grad():
        x = rms(model.model.embed_input_ids(torch.as_tensor(TOKENS[10:60])))
        _, k, v = attn.qkv_proj(x).split([Q_HEADS * D, H * D, H * D], dim=-1)
    db, dn = where(block_ids, range(10, 60))
    written = views[LAYERS[0]][db, :, dn]  # [50, H, 2D]
    assert same_bits(written[..., :D], k.view(50, H, D).to(dtype))
    assert same_bits(written[..., D:], v.view(50, H, D).to(dtype))


@DTYPE
@CASE
def test_a_repaired_semantic_load_matches_the_same_on_plain_caches(
    monkeypatch, backend, layout, dtype
):
    """Capture, semantic load and CacheBlend repair through the worker, over 0.33's views and
    over plain contiguous per-layer caches holding the same KV: the same bytes in the end."""
    config = SemShareConfig(recompute_policy="cacheblend")
    outcomes = []
    for plain in (False, True):
        w, _ = registered(monkeypatch, backend, layout, dtype, config=config, plain=plain)
        w.kv.repairer = Repairer(
            LayerRunner(LlamaForCausalLM(), dict(zip(LAYERS, w.kv.caches)), w.kv.layout),
            rope_table(),
            w.kv.layout.offsets(w.kv.caches[0]),
        )
        key = DonorKey("", "d")
        capture(w, key, [5, 2, 7], 40)
        spec = LoadSpec(
            "b",
            key,
            0,
            DST_START,
            NUM,
            [0, 3, 9, 10],
            policy="cacheblend",
            always=[DST_START],
            token_ids=TOKENS[: DST_START + NUM],
            donor_pos=DONOR_POS,
        )
        w.start_load_kv(SemShareConnectorMetadata(loads=[spec]))
        assert w.get_block_ids_with_load_errors() == set()
        assert w.stats.totals["recomputed_tokens"] > 0
        outcomes.append([plain_copy(c) for c in w.kv.caches])
        w.shutdown()
    for got, want in zip(*outcomes):
        assert same_bits(got, want)
