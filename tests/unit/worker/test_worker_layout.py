"""The worker half's checks at ``register_kv_caches`` (no engine): a KV layout it cannot address
turns it off, once, and the scheduler is told."""

import pytest
from support.worker import caches, geometry, make_worker

from semshare_vllm.config import SemShareConfig
from semshare_vllm.metadata import SemShareWorkerMetadata


def test_matching_blocks_register(monkeypatch):
    views = caches()
    w = make_worker(monkeypatch, bound={n: v[0] for n, v in views.items()})
    w.register_kv_caches({n: v[0] for n, v in views.items()})
    assert w.disabled is None and w.kv is not None and w.kv.store is not None
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
    assert w.kv is None  # no store, no caches held
    meta = w.build_worker_meta()  # sent although there is no capacity to report
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


def test_a_weight_update_one_rank_saw_is_every_ranks():
    seen = SemShareWorkerMetadata(weights_changed=True)
    assert seen.aggregate(SemShareWorkerMetadata()).weights_changed
    assert SemShareWorkerMetadata().aggregate(seen).weights_changed
    assert not SemShareWorkerMetadata().aggregate(SemShareWorkerMetadata()).weights_changed


def test_exact_only_kv_builds_no_layer_runner(monkeypatch):
    """Quantised (fp8) KV: exact page copies only; the runner is never built, and the scheduler
    hears the worker cannot repair approximate KV."""
    from semshare_vllm.vllm_compat import model_hook

    def no_model(_):
        raise AssertionError("the layer runner must not be built for quantised KV")

    monkeypatch.setattr(model_hook, "loaded_model", no_model)
    views = caches()
    w = make_worker(
        monkeypatch,
        geom=geometry(exact_only="fp8_e4m3 KV"),
        config=SemShareConfig(recompute_policy="all"),
        bound={n: v[0] for n, v in views.items()},
    )
    w.register_kv_caches({n: v[0] for n, v in views.items()})
    assert w.disabled is None and w.kv.repairer is None
    assert w.build_worker_meta().recompute_ready is False
    w.shutdown()
