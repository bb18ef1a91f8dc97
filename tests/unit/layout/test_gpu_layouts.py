"""vLLM 0.33's GPU KV layouts (FLASH_ATTN, TRITON_ATTN, FLASHINFER; every ``KVCacheLayout`` each
runs with, fp16 and bf16) as CPU tensors with their real shapes and strides
(``support/gpu_layouts.py`` says where in 0.33's source each comes from): they are the tensors
vLLM's own allocator makes; ``page_spec`` recognises each backend's, and its reads, writes,
offsets and layer stacks land where the backend's own reader looks; what we cannot read (an
unknown backend, MLA's latent cache) is declined, never misread."""

import os
from itertools import permutations
from types import SimpleNamespace

import pytest
import torch
from support.gpu_layouts import (
    ALL_LAYOUTS,
    BACKENDS,
    CASE_IDS,
    CASES,
    fill,
    vllm_kv_caches,
)
from support.worker import geometry, make_worker

from semshare_vllm.kernels import gather_rearrange, stage_rows
from semshare_vllm.layout.paged_cache import slots_for, stack_layers
from semshare_vllm.layout.specs import PackedKVSpec, UnsupportedKVLayout, WholePagesSpec, page_spec

LAYERS = tuple(f"model.layers.{i}.self_attn.attn" for i in range(3))
B, H, N, D = 6, 2, 16, 64
DTYPES = [torch.float16, torch.bfloat16]


def caches_of(layout, dtype, heads=H, head_size=D):
    return list(vllm_kv_caches(layout, LAYERS, B, heads, N, head_size, dtype).values())


def vllm_allocated(layout, dtype, spec=None):
    """The per-layer tensors vLLM's own planner and allocator make (the installed vLLM's
    ``get_kv_cache_config_from_groups`` and ``allocate_kv_cache``, the same source as 0.33's)."""
    try:
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
        from vllm.v1.kv_cache_layout import KVCacheLayout
        from vllm.v1.worker.utils import allocate_kv_cache

        try:
            from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
        except ImportError:  # 0.32 keeps it in kv_cache_utils
            from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
    except ImportError as exc:
        pytest.skip(f"this vLLM has no 0.33-style KV allocator: {exc}")
    spec = spec or FullAttentionSpec(block_size=N, num_kv_heads=H, head_size=D, dtype=dtype)
    lay = KVCacheLayout[layout]
    vllm_config = SimpleNamespace(
        cache_config=SimpleNamespace(
            get_resolved_kv_cache_layout=lambda: lay,
            num_gpu_blocks_override=None,
            prefix_cache_retention_interval=None,
        ),
        attention_config=SimpleNamespace(hisparse_config=None),
    )
    config = get_kv_cache_config_from_groups(
        vllm_config, [KVCacheGroupSpec(list(LAYERS), spec)], spec.page_size_bytes * len(LAYERS) * B
    )
    assert config.num_blocks == B
    return allocate_kv_cache(config, torch.device("cpu"), lay)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ALL_LAYOUTS)
def test_the_tensors_are_the_ones_vllm_allocates(layout, dtype):
    """Our stand-ins for 0.33's tensors are exactly vLLM's: shape, strides, offsets into one
    shared buffer, dtype (so every test below runs on the real thing)."""
    theirs = vllm_allocated(layout, dtype)
    ours = vllm_kv_caches(layout, LAYERS, B, H, N, D, dtype)
    assert list(theirs) == list(ours)
    for name in LAYERS:
        t, o = theirs[name], ours[name]
        assert (t.shape, t.stride(), t.storage_offset(), t.dtype) == (
            o.shape,
            o.stride(),
            o.storage_offset(),
            o.dtype,
        ), name
        assert t.untyped_storage().nbytes() == o.untyped_storage().nbytes()
    storages = {t.untyped_storage().data_ptr() for t in theirs.values()}
    assert len(storages) == 1  # one buffer for all layers, as ours


def test_the_default_layout_is_token_major():
    """0.33's default (LBNHC, the legacy NHD): each token's [H, 2D] is contiguous, so the
    logical [B, H, N, C] view is not; HND (LBHNC) is the plain row-major page."""
    nhd = caches_of("LBNHC", torch.float16)[0]
    assert not nhd.is_contiguous() and nhd.stride() == (N * H * 2 * D, 2 * D, H * 2 * D, 1)
    assert caches_of("LBHNC", torch.float16)[0].is_contiguous()


# (kv heads, head size): one KV head per rank (GQA under wide TP, where FlashInfer notes
# degenerate strides on the size-1 head axis) too.
GEOMETRIES = pytest.mark.parametrize("H, D", [(2, 64), (1, 128)], ids=["H2xD64", "H1xD128"])


@GEOMETRIES
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend, layout", CASES, ids=CASE_IDS)
def test_page_spec_reads_and_writes_where_the_backend_does(backend, layout, dtype, H, D):
    """Writes through the spec land where the backend's own reader (its split of the layer
    view) finds K and V of each token, in this layer only; reads by slot, by range and the
    kernels' offsets return what the backend's reader holds."""
    spec = page_spec(backend, D)
    assert isinstance(spec, PackedKVSpec)
    caches = caches_of(layout, dtype, H, D)
    for cache in caches:
        spec.check(cache)
    reads = BACKENDS[backend].reads
    slots = torch.tensor([0, 5, 17, 31, 40, 95])
    g = torch.Generator().manual_seed(1)
    k = torch.randn(len(slots), H, D, generator=g).to(dtype)
    v = torch.randn(len(slots), H, D, generator=g).to(dtype)
    spec.write(caches[1], slots, k, v)
    key, value, axes = reads(caches[1], layout, D)
    for i, s in enumerate(slots.tolist()):
        for h in range(H):
            at = {"B": s // N, "N": s % N, "H": h}
            index = tuple(at[a] for a in axes[:3])
            assert torch.equal(key[index], k[i, h]) and torch.equal(value[index], v[i, h])
    assert all(not c.any() for c in (caches[0], caches[2]))  # other layers untouched
    assert int((caches[1] != 0).sum()) == int((k != 0).sum() + (v != 0).sum())

    # Written by the backend (here: random everywhere), read by us.
    fill(caches, seed=2)
    key, value, axes = reads(caches[2], layout, D)
    plain = (
        key.permute(*[axes.index(a) for a in "BNHD"]),
        value.permute(*[axes.index(a) for a in "BNHD"]),
    )  # [B, N, H, D]
    rk, rv = spec.read(caches[2], slots)
    assert torch.equal(rk, plain[0].flatten(0, 1)[slots])
    assert torch.equal(rv, plain[1].flatten(0, 1)[slots])
    block_ids = [4, 1, 5, 0]
    rk, rv = spec.read_range(caches[2], block_ids, 7, 50)  # partial, whole and partial blocks
    want = slots_for(block_ids, 7, 57, N)
    assert torch.equal(rk, plain[0].flatten(0, 1)[want])
    assert torch.equal(rv, plain[1].flatten(0, 1)[want])
    staged = stage_rows(caches, slots, spec.offsets(caches[0]))  # [layers, M, H, 2D]
    for layer, cache in enumerate(caches):
        kk, vv = spec.read(cache, slots)
        assert torch.equal(staged[layer], torch.cat((kk, vv), dim=-1))


@pytest.mark.parametrize("impl", ["torch", "triton"])
@GEOMETRIES
@pytest.mark.parametrize("backend, layout", CASES, ids=CASE_IDS)
def test_the_gather_kernel_writes_as_on_a_plain_copy(backend, layout, H, D, impl):
    """``gather_rearrange`` (no rotation: where rows land is what the layout decides) into
    0.33's layer views, by torch and by the Triton kernel, gives the plain indexing's bytes."""
    if impl == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernel on CPU tensors needs TRITON_INTERPRET=1 (tests/conftest)")
    caches = caches_of(layout, torch.bfloat16, H, D)
    fill(caches)
    plain = [c.clone(memory_format=torch.contiguous_format) for c in caches]
    g = torch.Generator().manual_seed(4)
    src = torch.randn(len(LAYERS), 20, H, 2 * D, generator=g).to(torch.bfloat16)
    rows = torch.randint(0, 20, (33,), generator=g)
    slots = torch.randperm(B * N, generator=g)[:33]
    offsets = page_spec(backend, D).offsets(caches[0])
    gather_rearrange(src, rows, slots, caches, offsets, impl=impl)
    for layer, (cache, ref) in enumerate(zip(caches, plain)):
        ref[slots // N, :, slots % N] = src[layer, rows]
        assert torch.equal(cache.contiguous().view(torch.int16), ref.view(torch.int16))


def test_every_order_vllm_could_name_is_read_right():
    """0.33 names six of the 24 orders of [L, B, H, N] over a contiguous C (C must stay
    innermost: each layer view is retyped from int8); the packed spec reads strides off the
    tensor, so any of them, a future layout too, is read and written where plain indexing
    finds each token's K and V."""
    slots = torch.tensor([1, 16, 30, 77, 95])
    g = torch.Generator().manual_seed(3)
    k = torch.randn(len(slots), H, D, generator=g).half()
    v = torch.randn(len(slots), H, D, generator=g).half()
    spec = page_spec("FLASH_ATTN", D)
    for order in permutations("LBHN"):
        layout = "".join(order) + "C"
        caches = caches_of(layout, torch.float16)
        ref = torch.zeros(B, H, N, 2 * D, dtype=torch.float16)
        ref[slots // N, :, slots % N] = torch.cat((k, v), dim=-1)
        for cache in caches:
            spec.write(cache, slots, k, v)
            assert torch.equal(cache, ref), layout
        staged = stage_rows(caches, slots, spec.offsets(caches[0]))
        assert torch.equal(staged, torch.cat((k, v), dim=-1).expand(len(LAYERS), -1, -1, -1))


@pytest.mark.parametrize(
    "backend, heads, content, dtype",
    [
        # triton_attn.py TritonAttentionBackend.customize_spec, per-token-head modes: each
        # side's data then an fp32 scale inline, (D + D) * itemsize + 2 * 4 bytes
        ("TRITON_ATTN", H, 2 * D + 8, torch.uint8),  # fp8 / int8 per token-head
        ("TRITON_ATTN", H, D + 8, torch.uint8),  # int4 per token-head
        # flashinfer.py FlashInferBackend.customize_spec, NVFP4: K and V as separate head
        # slots (2 * H) of packed fp4 plus fp8 block scales, D / 2 + D / 16 bytes each
        ("FLASHINFER", 2 * H, D // 2 + D // 16, torch.uint8),
    ],
)
def test_quantised_pages_with_scales_inside_are_declined(
    monkeypatch, backend, heads, content, dtype
):
    """KV modes that keep their scales in the page (the geometry already declines their cache
    dtypes) are refused by the worker too, were it handed one: never read as plain K|V."""
    caches = {name: torch.zeros(B, heads, N, content, dtype=dtype) for name in LAYERS}
    with pytest.raises(UnsupportedKVLayout):
        page_spec(backend, D).check(caches[LAYERS[0]])
    for exact_only in (None, "fp8 KV"):
        geom = geometry(
            layer_names=LAYERS, block_size=N, num_kv_heads=H, head_size=D, exact_only=exact_only
        )
        w = make_worker(monkeypatch, geom=geom, bound=caches, backend=backend)
        w.register_kv_caches(caches)
        assert w.disabled and "UnsupportedKVLayout" in w.disabled and w.kv is None
        w.shutdown()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ALL_LAYOUTS)
def test_layer_stacks_are_views_of_the_one_buffer(layout, dtype):
    """``stack_layers`` (what captures, exact loads and the Triton kernel move all layers
    through) gives views of the layer tensors themselves, never a copy: one stack for all
    layers, also where they interleave inside each block (B outermost: one op, one kernel
    launch for all layers instead of one per layer)."""
    caches = caches_of(layout, dtype)
    fill(caches)
    stacks = stack_layers(caches)
    assert len(stacks) == 1
    covered = []
    for span, stack in stacks:
        for i, layer in zip(range(span.start, span.stop), stack):
            covered.append(i)
            assert layer.data_ptr() == caches[i].data_ptr()
            assert layer.stride() == caches[i].stride() and torch.equal(layer, caches[i])
    assert covered == list(range(len(LAYERS)))
    _, last = stacks[-1]
    last[-1, 3] = 0  # writes land in the layer tensor
    assert not caches[-1][3].any() and caches[-2][3].any()


@pytest.mark.parametrize("layout", ALL_LAYOUTS)
def test_an_unknown_backend_is_declined_but_copies_whole_pages(layout):
    """A backend we do not know: no token access (the worker turns itself off rather than
    guess at where K and V sit), raw page copies (quantised KV) still exact."""
    caches = caches_of(layout, torch.bfloat16)
    fill(caches)
    spec = page_spec("SOME_NEW_BACKEND", D)
    assert isinstance(spec, WholePagesSpec)
    with pytest.raises(UnsupportedKVLayout):
        spec.check(caches[0])
    with pytest.raises(UnsupportedKVLayout):
        spec.offsets(caches[0])
    pool = torch.zeros(len(LAYERS), 4, H, N, 2 * D, dtype=torch.bfloat16)
    for span, stack in stack_layers(caches):
        spec.copy_blocks(stack, [5, 2], pool[span], [0, 3])
    for layer, cache in enumerate(caches):
        assert torch.equal(pool[layer, 0], cache[5]) and torch.equal(pool[layer, 3], cache[2])


@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC"])
@pytest.mark.parametrize("backend", ["FLASHMLA", "FLASH_ATTN_MLA", "TRITON_MLA", "FLASH_ATTN"])
def test_mla_is_declined(monkeypatch, backend, layout):
    """MLA's latent cache (0.33: ``MLAAttentionSpec``, one head of kv_lora_rank + rope dims, no
    separate V), as vLLM allocates it: the geometry declines it (so neither half claims or
    captures), and a worker handed one anyway, under an MLA backend or a packed backend's name,
    turns itself off instead of reading the latent as K|V."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    from semshare_vllm.layout.geometry import kv_geometry

    spec = MLAAttentionSpec(block_size=N, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    caches = vllm_allocated(layout, torch.bfloat16, spec)
    assert next(iter(caches.values())).shape == (B, 1, N, 576)
    groups = [SimpleNamespace(kv_cache_spec=spec, layer_names=list(LAYERS))]
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(model="an-mla-model"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
    )
    geom = kv_geometry(vllm_config, SimpleNamespace(kv_cache_groups=groups))
    assert geom.unsupported and "MLAAttentionSpec" in geom.unsupported
    with pytest.raises(UnsupportedKVLayout):
        page_spec(backend, 576).check(caches[LAYERS[0]])
    for exact_only in (None, "fp8_e4m3 KV"):  # quantised KV checks whole pages only
        w = make_worker(
            monkeypatch,
            geom=geometry(
                layer_names=LAYERS,
                block_size=N,
                num_kv_heads=1,
                head_size=576,
                dtype=torch.bfloat16,
                exact_only=exact_only,
            ),
            bound=caches,
            backend=backend,
        )
        w.register_kv_caches(caches)
        assert w.disabled and "UnsupportedKVLayout" in w.disabled and w.kv is None
        w.shutdown()
