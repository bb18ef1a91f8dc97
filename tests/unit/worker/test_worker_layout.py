"""The worker half's checks at ``register_kv_caches`` (no engine): a KV layout it cannot address
turns it off, once, and the scheduler is told."""

from types import SimpleNamespace

import pytest
import torch

from semshare_vllm.config import SemShareConfig
from semshare_vllm.layout.geometry import KVGeometry
from semshare_vllm.metadata import SemShareWorkerMetadata
from semshare_vllm.worker import SemShareWorker

BS, H, D, BLOCKS = 32, 2, 32, 8
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")


def geometry(**kw):
    base = dict(layer_names=LAYERS, block_size=BS, num_kv_heads=H, head_size=D,
                dtype=torch.float32, tp_size=1, fingerprint="fp")
    base.update(kw)
    return KVGeometry(**base)


def fake_layer(bound):
    return SimpleNamespace(attn_backend=SimpleNamespace(get_name=lambda: "FLASH_ATTN"),
                           kv_cache=bound)


def caches(kernel_bs=BS):
    """Per layer: the manager view [B, H, N, 2D] and a kernel-block view of the same bytes."""
    r = BS // kernel_bs
    out = {}
    for name in LAYERS:
        flat = torch.zeros(BLOCKS, BS, H, 2 * D)                 # LBNHC: a block is one page
        manager = flat.permute(0, 2, 1, 3)                        # [B, H, N, 2D]
        kernel = flat.view(BLOCKS * r, kernel_bs, H, 2 * D).permute(0, 2, 1, 3)
        out[name] = (manager, kernel)
    return out


def make_worker(monkeypatch, geom=None, config=None, bound=None):
    bound = bound or {}
    ctx = {name: fake_layer(bound.get(name)) for name in LAYERS}
    vllm_config = SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context=ctx))
    # No vLLM distributed state here: the pool is a stand-in, nothing else is built.
    monkeypatch.setattr(SemShareWorker, "_make_store",
                        lambda self: SimpleNamespace(capacity_bytes=1 << 20, close=lambda: None))
    return SemShareWorker(config or SemShareConfig(recompute_policy="none"), geom or geometry(),
                          vllm_config)


def test_matching_blocks_register(monkeypatch):
    views = caches()
    w = make_worker(monkeypatch, bound={n: v[0] for n, v in views.items()})
    w.register_kv_caches({n: v[0] for n, v in views.items()})
    assert w.disabled is None and w.store is not None
    meta = w.build_worker_meta()
    assert meta.capacity_bytes == 1 << 20 and meta.disabled is None
    w.shutdown()


@pytest.mark.parametrize("where", ["registered", "bound"])
def test_kernel_block_split_disables_the_worker_and_tells_the_scheduler(monkeypatch, where):
    """vLLM splits each 32-token scheduler block into two 16-token kernel blocks: either the
    tensors the connector is handed, or the views bound to the attention layers, address kernel
    blocks, and the worker's block ids and slots would land in the wrong pages."""
    views = caches(kernel_bs=16)
    registered = {n: v[1] if where == "registered" else v[0] for n, v in views.items()}
    w = make_worker(monkeypatch, bound={n: v[1] for n, v in views.items()})
    w.register_kv_caches(registered)
    assert w.disabled and "kernel block" in w.disabled and "16" in w.disabled
    assert w.store is None and w.caches == []
    meta = w.build_worker_meta()          # sent although there is no capacity to report
    assert isinstance(meta, SemShareWorkerMetadata) and meta.disabled == w.disabled
    assert w.build_worker_meta() is None  # once
    w.shutdown()


def test_a_backend_that_takes_no_scheduler_sized_blocks_disables_it(monkeypatch):
    """No view bound to the layers yet: the backend's declared kernel block sizes decide."""
    views = caches()
    w = make_worker(monkeypatch)
    for layer in w._vllm_config.compilation_config.static_forward_context.values():
        layer.attn_backend.get_supported_kernel_block_sizes = lambda: [16]
    w.register_kv_caches({n: v[0] for n, v in views.items()})
    assert w.disabled and "kernel blocks of 16" in w.disabled
    w.shutdown()


def test_disabled_ranks_disable_all():
    ok = SemShareWorkerMetadata(capacity_bytes=10, recompute_ready=True)
    off = SemShareWorkerMetadata(disabled="rank 1: no memory")
    assert ok.aggregate(off).disabled == "rank 1: no memory"
    assert off.aggregate(ok).disabled == "rank 1: no memory"
    assert ok.aggregate(SemShareWorkerMetadata()).disabled is None


def test_exact_only_kv_builds_no_layer_runner(monkeypatch):
    """Quantised (fp8) KV: exact page copies only; the runner is never built, and the scheduler
    hears the worker cannot repair approximate KV."""
    from semshare_vllm.vllm_compat import model_hook

    def no_model(_):
        raise AssertionError("the layer runner must not be built for quantised KV")

    monkeypatch.setattr(model_hook, "loaded_model", no_model)
    views = caches()
    w = make_worker(monkeypatch, geom=geometry(exact_only="fp8_e4m3 KV"),
                    config=SemShareConfig(recompute_policy="all"),
                    bound={n: v[0] for n, v in views.items()})
    w.register_kv_caches({n: v[0] for n, v in views.items()})
    assert w.disabled is None and w.runner is None
    assert w.build_worker_meta().recompute_ready is False
    w.shutdown()
