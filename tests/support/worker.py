"""A worker half built without an engine: fake attention layers bound to hand-made KV views
(``vllm_config.compilation_config.static_forward_context``), and no vLLM distributed state (the
host store is patched in, ``setup.make_store``)."""

from types import SimpleNamespace

import torch

from semshare_vllm.config import SemShareConfig
from semshare_vllm.layout.geometry import KVGeometry
from semshare_vllm.worker import SemShareWorker, setup

BS, H, D, BLOCKS = 32, 2, 32, 8
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")


def geometry(**kw):
    base = dict(
        layer_names=LAYERS,
        block_size=BS,
        num_kv_heads=H,
        head_size=D,
        dtype=torch.float32,
        tp_size=1,
        fingerprint="fp",
    )
    base.update(kw)
    return KVGeometry(**base)


def fake_layer(bound, backend="FLASH_ATTN"):
    return SimpleNamespace(attn_backend=SimpleNamespace(get_name=lambda: backend), kv_cache=bound)


def caches(kernel_bs=BS):
    """Per layer: the manager view [B, H, N, 2D] and a kernel-block view of the same bytes."""
    r = BS // kernel_bs
    out = {}
    for name in LAYERS:
        flat = torch.zeros(BLOCKS, BS, H, 2 * D)  # LBNHC: a block is one page
        manager = flat.permute(0, 2, 1, 3)  # [B, H, N, 2D]
        kernel = flat.view(BLOCKS * r, kernel_bs, H, 2 * D).permute(0, 2, 1, 3)
        out[name] = (manager, kernel)
    return out


def make_worker(monkeypatch, geom=None, config=None, bound=None, backend="FLASH_ATTN"):
    bound = bound or {}
    geom = geom or geometry()
    ctx = {name: fake_layer(bound.get(name), backend) for name in geom.layer_names}
    vllm_config = SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context=ctx))
    # No vLLM distributed state here: rank 0, the pool a stand-in, nothing else is built.
    monkeypatch.setattr(setup.tensor_parallel, "tp_rank", lambda: 0)
    monkeypatch.setattr(
        setup, "make_store", lambda *a: SimpleNamespace(capacity_bytes=1 << 20, close=lambda: None)
    )
    return SemShareWorker(config or SemShareConfig(recompute_policy="none"), geom, vllm_config)
