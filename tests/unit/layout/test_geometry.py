"""``kv_geometry`` from small fake vLLM configs: what the fingerprint keys (persisted donors'
directory, LMCache model name, shared stream) and which KV formats the connector serves."""

import os
from types import SimpleNamespace

import pytest
import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec

from semshare_vllm.layout.geometry import kv_geometry

LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "llama", "rope_theta": 10000.0}')
    (d / "model.safetensors").write_bytes(b"\x01" * 64)
    (d / "tokenizer.json").write_text("{}")
    return d


def vllm_config(
    model,
    *,
    quantization=None,
    hf_overrides=None,
    rope_scaling=None,
    rope_theta=10000.0,
    cache_dtype="auto",
    calculate_kv_scales=False,
    revision=None,
    download_dir=None,
    load_format="auto",
    max_model_len=2048,
    model_weights="",
):
    hf_config = SimpleNamespace(
        rope_scaling=rope_scaling, rope_theta=rope_theta, max_position_embeddings=4096
    )
    return SimpleNamespace(
        model_config=SimpleNamespace(
            model=str(model),
            revision=revision,
            quantization=quantization,
            hf_overrides=hf_overrides or {},
            hf_config=hf_config,
            hf_text_config=hf_config,
            dtype=torch.float16,
            tokenizer=str(model),
            max_model_len=max_model_len,
            model_weights=model_weights,
        ),
        cache_config=SimpleNamespace(
            cache_dtype=cache_dtype, block_size=16, calculate_kv_scales=calculate_kv_scales
        ),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        load_config=SimpleNamespace(download_dir=download_dir, load_format=load_format),
    )


def kv_cache_config(dtype=torch.float16):
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=dtype)
    return SimpleNamespace(
        kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=list(LAYERS))]
    )


def fp(model, **kw):
    g = kv_geometry(vllm_config(model, **kw), kv_cache_config())
    assert g.unsupported is None
    return g.fingerprint


def local_only(model, **kw):
    g = kv_geometry(vllm_config(model, **kw), kv_cache_config())
    assert g.unsupported is None
    return g.local_only


def test_same_inputs_same_fingerprint(model_dir):
    assert fp(model_dir) == fp(model_dir)
    assert fp(model_dir, rope_scaling={"rope_type": "yarn", "factor": 2.0}) == fp(
        model_dir, rope_scaling={"factor": 2.0, "rope_type": "yarn"}
    )
    # a callable override is named, not printed with its address
    assert fp(model_dir, hf_overrides=lambda c: c) == fp(model_dir, hf_overrides=lambda c: c)


@pytest.mark.parametrize(
    "how", ["rewrite", "size", "same_stats", "new_shard", "index", "config", "code"]
)
def test_other_weights_at_the_same_path_change_the_fingerprint(model_dir, how):
    weights = model_dir / "model.safetensors"
    st = weights.stat()
    old_ns = st.st_mtime_ns - 10**10  # written 10 s ago
    os.utime(weights, ns=(old_ns, old_ns))
    before = fp(model_dir)
    if how == "rewrite":  # a new checkpoint saved over the old one: same name and size
        weights.write_bytes(b"\x02" * 64)
    elif how == "size":  # same mtime, other size
        weights.write_bytes(b"\x01" * 65)
        os.utime(weights, ns=(old_ns, old_ns))
    elif how == "same_stats":  # other content, same name, size and mtime (a normalising copy)
        weights.write_bytes(b"\x04" * 64)
        os.utime(weights, ns=(old_ns, old_ns))
        assert (weights.stat().st_size, weights.stat().st_mtime_ns) == (st.st_size, old_ns)
    elif how == "code":  # the model's own code (trust_remote_code), same size and mtime
        code = model_dir / "modeling_x.py"
        code.write_text("A = 1")
        os.utime(code, ns=(old_ns, old_ns))
        before = fp(model_dir)
        code.write_text("A = 2")
        os.utime(code, ns=(old_ns, old_ns))
    elif how == "new_shard":
        (model_dir / "model-00002-of-00002.bin").write_bytes(b"\x03")
    elif how == "index":
        (model_dir / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    elif how == "config":
        (model_dir / "config.json").write_text('{"model_type": "llama", "rope_theta": 5e5}')
    assert fp(model_dir) != before


def test_the_same_weights_touched_keep_it(model_dir):
    """Known by content: a copy whose timestamps moved (another machine's download) is still
    these weights, so instances sharing donors need not agree on mtimes."""
    (model_dir / "training_args.bin").write_bytes(b"\x01" * 8)  # (what vLLM does not load)
    (model_dir / "pytorch_model.bin").write_bytes(b"\x01" * 8)
    before = fp(model_dir)
    for name in ("model.safetensors", "training_args.bin", "pytorch_model.bin"):
        os.utime(model_dir / name, ns=(5, 5))
    assert fp(model_dir) == before


def test_files_that_are_not_weights_do_not_change_it(model_dir):
    before = fp(model_dir)
    (model_dir / "tokenizer.json").write_text('{"other": 1}')
    (model_dir / "README.md").write_text("hello")
    assert fp(model_dir) == before


@pytest.mark.parametrize(
    "change",
    [
        dict(quantization="fp8"),
        dict(quantization="awq"),
        dict(hf_overrides={"rope_theta": 500000.0}),
        dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}),
        dict(rope_theta=500000.0),
        dict(cache_dtype="fp8_e5m2"),
    ],
)
def test_quantisation_rope_and_cache_dtype_change_it(model_dir, change):
    base = dict(cache_dtype="fp8_e4m3") if "cache_dtype" in change else {}
    assert fp(model_dir, **base) != fp(model_dir, **change)


def test_hub_id_is_keyed_by_its_cached_snapshot_commit(tmp_path):
    cache = tmp_path / "hub"
    repo = cache / "models--org--tiny"
    for commit in ("a" * 40, "b" * 40):
        snap = repo / "snapshots" / commit
        snap.mkdir(parents=True)
        (snap / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    first = fp("org/tiny", download_dir=str(cache))
    assert first == fp("org/tiny", download_dir=str(cache))
    (repo / "refs" / "main").write_text("b" * 40)
    assert fp("org/tiny", download_dir=str(cache)) != first
    # pinned to a commit: that commit, whatever main says
    assert fp("org/tiny", download_dir=str(cache), revision="a" * 40) == first
    assert local_only("org/tiny", download_dir=str(cache)) is None


def test_a_hub_id_with_no_cached_snapshot_keeps_its_donors_in_the_process(tmp_path):
    """Not in the cache vLLM downloads to (ModelScope, another cache): its name alone would key
    every version of the repository alike, so its donors are neither persisted nor shared."""
    cache = tmp_path / "hub"
    cache.mkdir()
    reason = local_only("org/absent", download_dir=str(cache), revision="v1")
    assert reason and "org/absent" in reason


def test_random_weights_are_keyed_apart_and_never_leave_the_process(model_dir):
    """``load_format`` "dummy" computes with random weights read from no file: keyed by the
    path alone, its donors were restored by a restart on the real checkpoint and served as
    exact prefixes (a wrong answer; ``tests/engine/test_engine_weights.py``)."""
    assert fp(model_dir, load_format="dummy") != fp(model_dir)
    reason = local_only(model_dir, load_format="dummy")
    assert reason and "dummy" in reason
    assert (
        local_only(model_dir) is None and local_only(model_dir, load_format="safetensors") is None
    )
    assert fp(model_dir, load_format="safetensors") != fp(model_dir)


def test_weights_streamed_from_object_storage_never_leave_the_process(tmp_path):
    """vLLM's object-storage models (``s3://``): ``model`` becomes a mirror of the config and
    tokenizer files, the weights stay at the URL; nothing here tells one upload from the next."""
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    (mirror / "config.json").write_text('{"model_type": "llama"}')
    reason = local_only(mirror, model_weights="s3://bucket/model")
    assert reason and "s3://bucket/model" in reason


def test_a_local_model_without_weight_files_never_leaves_the_process(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "llama"}')
    assert local_only(d)


def test_max_model_len_changes_it(model_dir):
    """vLLM picks LongRoPE's long or short factors by ``max_model_len``: the same tokens get
    other keys (a restart that changed only ``--max-model-len`` served the other factors' KV
    as exact prefixes of a tiny Phi-3 in the reviewer's run)."""
    longrope = {
        "rope_type": "longrope",
        "short_factor": [1.0] * 16,
        "long_factor": [2.0] * 16,
        "original_max_position_embeddings": 4096,
    }
    assert fp(model_dir, rope_scaling=longrope, max_model_len=4096) != fp(
        model_dir, rope_scaling=longrope, max_model_len=131072
    )


def test_the_models_own_code_changes_it(model_dir):
    """A local model's remote code (``trust_remote_code``) computes its KV as much as its
    weights do."""
    (model_dir / "modeling_custom.py").write_text("def forward(x): return x\n")
    before = fp(model_dir)
    (model_dir / "modeling_custom.py").write_text("def forward(x): return 2 * x  # new\n")
    assert fp(model_dir) != before
    # a hub model's code at another revision than its weights
    config = vllm_config(model_dir)
    config.model_config.code_revision = "v2"
    assert kv_geometry(config, kv_cache_config()).fingerprint != fp(model_dir)


def test_the_vllm_version_changes_it(model_dir, monkeypatch):
    """Persisted pages are vLLM's own page bytes: another vLLM may lay them out or compute
    them otherwise under the same layout name."""
    import vllm

    before = fp(model_dir)
    monkeypatch.setattr(vllm, "__version__", "0.0.0-other")
    assert fp(model_dir) != before


# ---- KV formats ---------------------------------------------------------------------------------
def geometry_for(model_dir, cache_dtype, calculate_kv_scales=False):
    return kv_geometry(
        vllm_config(model_dir, cache_dtype=cache_dtype, calculate_kv_scales=calculate_kv_scales),
        kv_cache_config(),
    )


@pytest.mark.parametrize("cache_dtype", ["auto", "float16", "bfloat16"])
def test_plain_kv_is_fully_supported(model_dir, cache_dtype):
    g = geometry_for(model_dir, cache_dtype)
    assert g.unsupported is None and g.exact_only is None


@pytest.mark.parametrize("cache_dtype", ["fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc"])
def test_per_tensor_fp8_is_exact_prefix_only(model_dir, cache_dtype):
    g = geometry_for(model_dir, cache_dtype)
    assert g.unsupported is None
    assert g.exact_only and cache_dtype in g.exact_only


def test_fp8_with_computed_scales_is_declined(model_dir):
    g = geometry_for(model_dir, "fp8_e4m3", calculate_kv_scales=True)
    assert g.unsupported and "calculate_kv_scales" in g.unsupported


@pytest.mark.parametrize(
    "cache_dtype",
    [
        "int8_per_token_head",
        "fp8_per_token_head",
        "int4_per_token_head",
        "nvfp4",
        "nvfp4_4over6",
        "turboquant_k8v4",
        "ultraquant_4bit",
        "int8",
    ],
)
def test_other_quantised_kv_is_declined(model_dir, cache_dtype):
    g = geometry_for(model_dir, cache_dtype)
    assert g.unsupported and cache_dtype in g.unsupported


@pytest.mark.parametrize("name", ["decode_context_parallel_size", "prefill_context_parallel_size"])
def test_context_parallelism_is_declined(model_dir, name):
    """With context parallelism a request's tokens are spread over ranks (vLLM hashes blocks
    of ``block_size`` times the ranks): a block here is not the KV of consecutive tokens."""
    config = vllm_config(model_dir)
    setattr(config.parallel_config, name, 2)
    g = kv_geometry(config, kv_cache_config())
    assert g.unsupported and "context parallel" in g.unsupported
    setattr(config.parallel_config, name, 1)
    assert kv_geometry(config, kv_cache_config()).unsupported is None


def test_an_engine_whose_plugins_leave_ours_out_never_lets_donors_leave_the_process(
    model_dir, monkeypatch
):
    """``VLLM_PLUGINS`` without our plugin: the model's ``load_weights`` goes unseen (the
    plugin wraps the model as it loads), so a training loop's sync through it would leave
    donors of other weights under the checkpoint's fingerprint (the second review). Such an
    engine persists and shares nothing; with our plugin listed, or no list, it does."""
    from importlib.metadata import entry_points

    from semshare_vllm.vllm_compat import weight_updates

    (ours,) = [e for e in entry_points(group="vllm.general_plugins") if "semshare" in e.value]
    assert ours.name == weight_updates.PLUGIN
    monkeypatch.setenv("VLLM_PLUGINS", "none")
    reason = local_only(model_dir)
    assert reason and "VLLM_PLUGINS" in reason
    monkeypatch.setenv("VLLM_PLUGINS", f"other,{weight_updates.PLUGIN}")
    assert local_only(model_dir) is None
    monkeypatch.delenv("VLLM_PLUGINS")
    assert local_only(model_dir) is None


@pytest.mark.parametrize("unread", ["model.safetensors", "config.json", "scales.json"])
def test_a_file_whose_content_cannot_be_read_keeps_donors_in_this_process(
    model_dir, unread, monkeypatch
):
    """An unreadable file (or one that changed as it was read) has no digest: two such files
    must not key alike, so the engine persists and shares nothing. For the weights, the model's
    configuration files and a file a setting names."""
    from semshare_vllm.core import file_digest

    (model_dir / "scales.json").write_text("{}")
    real = file_digest.digest
    monkeypatch.setattr(file_digest, "digest", lambda p: None if p.name == unread else real(p))
    for module in ("semshare_vllm.core.files", "semshare_vllm.layout.identity"):
        monkeypatch.setattr(f"{module}.digest", file_digest.digest)
    scales = {"scale_file": str(model_dir / "scales.json")}
    reason = local_only(model_dir, hf_overrides=scales)
    assert reason is not None and unread in reason


@pytest.mark.parametrize("load_format", ["auto", "pt"])
def test_files_vllm_does_not_load_are_known_by_stats(model_dir, load_format, monkeypatch):
    """vLLM reads safetensors first (``pt``: ``*.pt`` only), and never a trainer's files: a
    repository's .bin copy beside safetensors and optimizer.pt are not read in full, yet still
    key the identity."""
    from semshare_vllm.core import file_digest

    (model_dir / "pytorch_model.bin").write_bytes(b"\x01" * 32)
    (model_dir / "optimizer.pt").write_bytes(b"\x01" * 32)
    read = []
    real = file_digest.digest
    monkeypatch.setattr("semshare_vllm.core.files.digest", lambda p: read.append(p.name) or real(p))
    before = fp(model_dir, load_format=load_format)
    assert "pytorch_model.bin" not in read and "model.safetensors" in read
    assert "optimizer.pt" not in read
    for name in ("pytorch_model.bin", "optimizer.pt"):
        (model_dir / name).write_bytes(b"\x02" * 33)
        assert fp(model_dir, load_format=load_format) != before
        before = fp(model_dir, load_format=load_format)


def test_a_hidden_safetensors_file_is_not_what_vllm_loads(model_dir, monkeypatch):
    from semshare_vllm.core import file_digest

    (model_dir / "model.safetensors").unlink()
    (model_dir / "pytorch_model.bin").write_bytes(b"\x01" * 32)
    (model_dir / "._model.safetensors").write_bytes(b"\x00" * 8)
    read = []
    real = file_digest.digest
    monkeypatch.setattr("semshare_vllm.core.files.digest", lambda p: read.append(p.name) or real(p))
    fp(model_dir)
    assert "pytorch_model.bin" in read


def test_a_single_file_checkpoint_without_a_config_beside_it_is_identified(tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + b"\x00" * 60)
    assert local_only(gguf) is None
    before = fp(gguf)
    gguf.write_bytes(b"GGUF" + b"\x01" * 60)
    assert fp(gguf) != before


def test_a_directory_with_a_trainers_files_but_no_weights_has_no_weight_files(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "llama"}')
    (d / "modeling_x.py").write_text("A = 1")
    (d / "training_args.bin").write_bytes(b"\x01" * 8)
    reason = local_only(d)
    assert reason is not None and "no weight files" in reason
