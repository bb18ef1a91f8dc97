"""What keeps donors of one engine configuration from another's, on vLLM's real ``ModelConfig``
(a tiny local Llama config; no weights are read): settings that change a prompt's KV without
changing its shape must change the fingerprint (persisted donors' directory, LMCache's model
name, the shared stream), and weights nothing identifies must keep their donors in the process.
And the identity is of what the engine loaded: the model hook takes it just before the load,
so files replaced during start-up never lend the engine another checkpoint's fingerprint.
Each test failed before the identity was widened (the audit of 77bf3dc)."""

import json
import os
from types import SimpleNamespace

import pytest
import torch
from vllm.config import ModelConfig
from vllm.v1.kv_cache_interface import FullAttentionSpec

from semshare_vllm.layout.geometry import kv_geometry
from semshare_vllm.vllm_compat import model_hook

LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 256,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "torch_dtype": "float16",
}


def write_model(d, fill=b"\x01", **config):
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({**CONFIG, **config}))
    (d / "model.safetensors").write_bytes(fill * 64)
    return d


@pytest.fixture
def model_dir(tmp_path):
    return write_model(tmp_path / "model")


class Engine(SimpleNamespace):
    """A stand-in ``VllmConfig``: the model hook holds it weakly, as it does vLLM's."""


def engine_config(model_config, load_config=None, **extra):
    return Engine(
        model_config=model_config,
        cache_config=SimpleNamespace(cache_dtype="auto", block_size=16),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        load_config=load_config or SimpleNamespace(download_dir=None, load_format="auto"),
        kv_transfer_config=SimpleNamespace(
            kv_connector="SemShareConnector", kv_connector_module_path=None
        ),
        **extra,
    )


def kv_cache_config():
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=16, dtype=torch.float16)
    return SimpleNamespace(
        kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=list(LAYERS))]
    )


def geometry(model_config, load_config=None, **extra):
    g = kv_geometry(engine_config(model_config, load_config, **extra), kv_cache_config())
    assert g.unsupported is None
    return g


def fp(model_config, load_config=None, **extra):
    g = geometry(model_config, load_config, **extra)
    assert g.local_only is None, g.local_only
    return g.fingerprint


def mc(model, **kw):
    return ModelConfig(model=str(model), skip_tokenizer_init=True, dtype="float16", **kw)


# ---- settings that change the KV of the same tokens ----------------------------------------------
def test_online_quantisation_settings_change_it(model_dir):
    """``--quantization online --quantization-config``: per-tensor or per-channel fp8 weights,
    or the attention projections left unquantised, are other weights under one method name."""
    configs = [
        {"linear": "fp8_per_tensor_static"},
        {"linear": "fp8_per_channel_static"},
        {"linear": "fp8_per_tensor_static", "ignore": ["re:.*self_attn.*"]},
    ]
    models = [mc(model_dir, quantization="online", quantization_config=c) for c in configs]
    assert {m.quantization for m in models} == {"online"}
    assert len({fp(m) for m in models}) == 3


def test_a_model_config_from_elsewhere_changes_it(model_dir, tmp_path):
    """``--hf-config-path``: the architecture comes from another directory (here another
    ``rms_norm_eps``), not from the model's own config.json."""
    other = write_model(tmp_path / "cfg", rms_norm_eps=1e-2)
    a, b = mc(model_dir), mc(model_dir, hf_config_path=str(other))
    assert a.hf_config.rms_norm_eps != b.hf_config.rms_norm_eps
    assert fp(a) != fp(b)


def _eps_override(value):
    def hf_overrides(cfg):  # one __qualname__ whatever the value
        cfg.rms_norm_eps = value
        return cfg

    return hf_overrides


def test_callable_hf_overrides_are_keyed_by_what_they_do(model_dir):
    a = mc(model_dir, hf_overrides=_eps_override(1e-5))
    b = mc(model_dir, hf_overrides=_eps_override(1e-1))
    assert a.hf_config.rms_norm_eps != b.hf_config.rms_norm_eps
    assert fp(a) != fp(b)
    assert fp(a) == fp(mc(model_dir, hf_overrides=_eps_override(1e-5)))


def test_a_settings_file_is_keyed_by_its_content(model_dir, tmp_path):
    """``hf_overrides={"quantization_config_file": path}``: the same path with other
    content is another model."""
    f = tmp_path / "quant.json"
    f.write_text('{"group_size": 128}')
    a = fp(mc(model_dir, hf_overrides={"quantization_config_file": str(f)}))
    f.write_text('{"group_size": 32}')
    assert fp(mc(model_dir, hf_overrides={"quantization_config_file": str(f)})) != a


@pytest.mark.parametrize(
    "name", ["hf_quant_config.json", "quantize_config.json", "quant_config.json", "params.json"]
)
def test_the_models_quant_method_files_and_params_change_it(model_dir, name):
    """Read by vLLM beside config.json (a quant method's ``get_config_filenames``, Mistral's
    params.json): neither weights nor config.json, and no less the model."""
    m = mc(model_dir)
    a = fp(m)
    (model_dir / name).write_text('{"exclude_modules": []}')
    b = fp(m)
    (model_dir / name).write_text('{"exclude_modules": ["lm_head"]}')
    assert len({a, b, fp(m)}) == 3


def test_the_draft_model_changes_it(model_dir, tmp_path):
    """A draft's (EAGLE's) attention layers share the KV cache with the target's: its name,
    and its weights at the same path."""
    m = mc(model_dir)
    a = fp(m, speculative_config=SimpleNamespace(model="eagle-v1", method="eagle"))
    b = fp(m, speculative_config=SimpleNamespace(model="eagle-v2", method="eagle"))
    assert a != b != fp(m)
    draft_dir = write_model(tmp_path / "draft")

    def with_draft():
        draft = SimpleNamespace(model=str(draft_dir), revision=None)
        spec = SimpleNamespace(model=str(draft_dir), method="draft_model", draft_model_config=draft)
        return fp(m, speculative_config=spec)

    before = with_draft()
    (draft_dir / "model.safetensors").write_bytes(b"\x07" * 64)
    assert with_draft() != before


def test_a_draft_whose_weights_are_not_known_keeps_donors_in_this_process(model_dir):
    """A draft given as a hub id with no cached snapshot: nothing tells its versions apart."""
    draft = SimpleNamespace(model="org/not-cached-draft", revision=None)
    spec = SimpleNamespace(model=draft.model, method="draft_model", draft_model_config=draft)
    reason = geometry(mc(model_dir), speculative_config=spec).local_only
    assert reason is not None and "draft" in reason


def test_a_draft_downloaded_where_the_target_was_is_known_by_its_snapshot(model_dir, tmp_path):
    """Without a load config of its own, vLLM loads the draft with the target's (its
    ``download_dir``): its snapshot is looked for there."""
    cache = tmp_path / "hub"
    snap = cache / "models--org--draft" / "snapshots" / ("a" * 40)
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (cache / "models--org--draft" / "refs").mkdir()
    (cache / "models--org--draft" / "refs" / "main").write_text("a" * 40)
    draft = SimpleNamespace(model="org/draft", revision=None)
    spec = SimpleNamespace(model="org/draft", method="draft_model", draft_model_config=draft)
    load = SimpleNamespace(download_dir=str(cache), load_format="auto")
    assert geometry(mc(model_dir), load, speculative_config=spec).local_only is None


def test_a_loader_option_named_like_our_identity_is_only_an_option(model_dir):
    """Settings are the user's: one holding ``{"local": ...}`` is not a weights identity."""
    extra = {"local": {"enabled": True}, "files": [1, 2], "file": "x", "content": None}
    load = SimpleNamespace(download_dir=None, load_format="auto", model_loader_extra_config=extra)
    assert geometry(mc(model_dir), load).local_only is None


def test_the_draft_files_names_are_not_files_of_the_working_directory(
    model_dir, tmp_path, monkeypatch
):
    """The draft's identity lists its files by name (``model.safetensors``): such a name must
    not be taken for a file of the working directory and keyed by that file's content."""
    m = mc(model_dir)
    draft_dir = write_model(tmp_path / "draft")
    draft = SimpleNamespace(model=str(draft_dir), revision=None)
    spec = SimpleNamespace(model=str(draft_dir), method="draft_model", draft_model_config=draft)
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    before = fp(m, speculative_config=spec)
    (elsewhere / "model.safetensors").write_bytes(b"\x09" * 8)
    (elsewhere / "config.json").write_text("{}")
    assert fp(m, speculative_config=spec) == before


def test_multimodal_processing_settings_change_it_and_cache_sizes_do_not(model_dir):
    from vllm.config.multimodal import MultiModalConfig

    m = mc(model_dir)

    def with_mm(**kw):
        m.multimodal_config = MultiModalConfig(**kw)
        return fp(m)

    base = with_mm()
    assert with_mm(mm_processor_kwargs={"num_crops": 4}) != base
    assert with_mm(media_io_kwargs={"video": {"num_frames": 8}}) != base
    assert with_mm(video_pruning_rate=0.5) != base
    assert with_mm(mm_processor_cache_gb=1) == base


def test_the_model_implementation_changes_it(model_dir):
    assert fp(mc(model_dir, model_impl="transformers")) != fp(mc(model_dir))


def test_a_local_tensorizer_file_is_keyed_by_its_content(model_dir, tmp_path):
    tensors = tmp_path / "model.tensors"
    tensors.write_bytes(b"\x01" * 32)

    def load():
        return SimpleNamespace(
            download_dir=None,
            load_format="tensorizer",
            model_loader_extra_config={"tensorizer_uri": str(tensors)},
        )

    m = mc(model_dir)
    a = fp(m, load())
    tensors.write_bytes(b"\x02" * 32)
    assert fp(m, load()) != a


def test_a_length_fitted_to_memory_after_the_load_keeps_the_fingerprint(model_dir, runner_class):
    """``--max-model-len auto`` (-1): the engine core fits ``max_model_len`` to the KV memory
    after the workers loaded the model, then tells them. A worker's fingerprint is of the
    identity taken before its load; the scheduler, in another process under tensor
    parallelism, computes its own after the fit. Keyed by the length asked for (the one the
    model was built with), they agree (the review: they differed on every such start)."""
    worker_config = engine_config(mc(model_dir, max_model_len=-1))
    assert worker_config.model_config.max_model_len == 512
    runner_class(worker_config).load_model()
    worker_config.model_config.max_model_len = 300  # vLLM's update_max_model_len
    scheduler_config = engine_config(mc(model_dir, max_model_len=-1))
    scheduler_config.model_config.max_model_len = 300  # fitted before this half is built
    worker = kv_geometry(worker_config, kv_cache_config())
    scheduler = kv_geometry(scheduler_config, kv_cache_config())
    assert worker.local_only is None and worker.fingerprint == scheduler.fingerprint
    assert fp(mc(model_dir, max_model_len=256)) != scheduler.fingerprint  # another length asked


def test_a_length_lowered_before_the_load_is_keyed_as_lowered(tmp_path, runner_class):
    """vLLM 0.33 lowers ``max_model_len`` to a draft's (``_limit_max_model_len_to_draft``: V2
    runner, method draft_model) after ModelConfig noted the length asked for; LongRoPE picks its
    factors by the lowered one (the second review: one fingerprint for both)."""
    model = write_model(tmp_path / "m", max_position_embeddings=8192)
    asked = engine_config(mc(model, max_model_len=4096))
    lowered = engine_config(mc(model, max_model_len=4096))
    lowered.model_config.max_model_len = 1024
    for config in (asked, lowered):
        runner_class(config).load_model()
    a, b = (kv_geometry(c, kv_cache_config()) for c in (asked, lowered))
    assert a.local_only is None and b.local_only is None
    assert a.fingerprint != b.fingerprint


def test_a_model_that_cannot_be_identified_starts_and_keeps_its_donors(model_dir, monkeypatch):
    from semshare_vllm.layout import identity

    def unreadable(path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(identity, "_local_weights", unreadable)
    reason = geometry(mc(model_dir)).local_only
    assert reason and "could not be identified" in reason


# ---- weights nothing here identifies -------------------------------------------------------------
@pytest.mark.parametrize(
    "load_format, extra",
    [
        ("tensorizer", {"tensorizer_uri": "s3://bucket/ft-v1/model.tensors"}),
        ("ipc_cache", {}),
        ("modelexpress", {}),
        ("npcache", {}),  # its numpy copy outlives a change of the .bin files
        ("my_plugins_loader", {}),
    ],
)
def test_weights_from_elsewhere_never_leave_the_process(model_dir, load_format, extra):
    """A tensorizer URI, another process's memory, a peer, a loader we do not know: the files
    under ``model`` are not the weights, and nothing here versions the ones that are."""
    load = SimpleNamespace(
        download_dir=None, load_format=load_format, model_loader_extra_config=extra
    )
    reason = geometry(mc(model_dir), load).local_only
    assert reason and load_format in reason


# ---- the identity of what was loaded -------------------------------------------------------------
@pytest.fixture
def runner_class(monkeypatch):
    """A runner class wrapped by the model hook whose load calls ``during`` (if set)."""
    monkeypatch.setattr(model_hook, "_identities", {})

    class Runner:
        during = None

        def __init__(self, config):
            self.vllm_config = config

        def load_model(self):
            if self.during is not None:
                self.during()
            self.model = Engine()  # (held weakly, as a real model)

    assert model_hook._wrap(Runner)
    return Runner


def swappable_checkpoints(tmp_path):
    for step, fill in (("step1", b"\x01"), ("step2", b"\x02")):
        write_model(tmp_path / step, fill)
    latest = tmp_path / "latest"
    latest.symlink_to(tmp_path / "step1")

    def swap():
        latest.unlink()
        latest.symlink_to(tmp_path / "step2")

    return latest, swap


def test_files_replaced_after_the_load_lend_the_engine_no_other_fingerprint(tmp_path, runner_class):
    """``vllm serve /ckpt/latest``; a trainer points ``latest`` at step 2 after vLLM loaded
    step 1's weights and before the connector is built (KV profiling, compilation). Before:
    the engine computed with step 1 and filed its donors under step 2's fingerprint, the one a
    restart on step 2 computes, which then served them as exact."""
    latest, swap = swappable_checkpoints(tmp_path)
    config = engine_config(mc(latest))
    runner_class(config).load_model()  # step 1's weights
    swap()
    restart_on_step2 = kv_geometry(engine_config(mc(latest)), kv_cache_config())
    engine = kv_geometry(config, kv_cache_config())
    assert engine.fingerprint != restart_on_step2.fingerprint
    assert engine.local_only and "after vLLM loaded them" in engine.local_only
    assert restart_on_step2.local_only is None


def test_files_replaced_during_the_load_keep_donors_in_the_process(tmp_path, runner_class):
    latest, swap = swappable_checkpoints(tmp_path)
    config = engine_config(mc(latest))
    runner = runner_class(config)
    runner.during = swap  # some shards read from step 1, some from step 2
    runner.load_model()
    g = kv_geometry(config, kv_cache_config())
    assert g.local_only and "while vLLM loaded them" in g.local_only


def test_an_unchanged_checkpoint_has_the_fingerprint_of_its_load(model_dir, runner_class):
    """The identity taken before the load is the one a process that never saw the load (the
    scheduler's, with workers in their own processes) computes: the two halves agree."""
    config = engine_config(mc(model_dir))
    runner_class(config).load_model()
    assert model_hook.identity_at_load(config) is not None
    g = kv_geometry(config, kv_cache_config())
    assert g.local_only is None
    assert g.fingerprint == fp(mc(model_dir))


def test_a_config_changed_by_the_models_load_keeps_the_fingerprint_of_before(
    model_dir, runner_class
):
    """vLLM's loaders write into the Hugging Face config as they load (the quant config's
    head counts): in one process the scheduler reads the changed config, in another the
    unchanged one. The identity taken before the load is the same for both."""
    config = engine_config(mc(model_dir))
    unchanged = fp(mc(model_dir))
    runner = runner_class(config)
    runner.during = lambda: setattr(config.model_config.hf_config, "total_num_heads", 4)
    runner.load_model()
    assert kv_geometry(config, kv_cache_config()).fingerprint == unchanged


def test_inside_a_multiconnector_the_identity_is_still_the_one_loaded(tmp_path, runner_class):
    """vLLM's ``MultiConnector`` lists ours among its connectors and builds each on a shallow
    copy of the engine's config (the second review: no identity was taken, and the copy found
    none, so a checkpoint swapped after the load lent its name to the engine's donors)."""
    import copy

    latest, swap = swappable_checkpoints(tmp_path)
    config = engine_config(mc(latest))
    config.kv_transfer_config = SimpleNamespace(
        kv_connector="MultiConnector",
        kv_connector_module_path=None,
        kv_connector_extra_config={
            "connectors": [{"kv_connector": "NixlConnector"}, {"kv_connector": "SemShareConnector"}]
        },
    )
    runner_class(config).load_model()
    assert model_hook.loaded_model(config) is None  # (recompute stays off in there)
    swap()
    ours = copy.copy(config)  # what MultiConnector hands our connector
    ours.kv_transfer_config = SimpleNamespace(
        kv_connector="SemShareConnector", kv_connector_module_path=None
    )
    g = kv_geometry(ours, kv_cache_config())
    assert g.local_only and "after vLLM loaded them" in g.local_only


def test_a_bare_word_is_no_file_name_whatever_the_working_directory_holds(
    model_dir, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    m = mc(model_dir, hf_overrides={"attn_mode": "fp8"})
    before = fp(m)
    (tmp_path / "fp8").write_text("something")
    assert fp(m) == before


def test_another_engines_record_never_answers_for_this_one(model_dir, tmp_path, runner_class):
    loaded = engine_config(mc(model_dir))
    runner_class(loaded).load_model()
    other = engine_config(mc(write_model(tmp_path / "other", b"\x05")))
    assert model_hook.identity_at_load(other) is None
    assert model_hook.identity_at_load(loaded) is not None
    os.utime(model_dir / "model.safetensors", ns=(1, 1))  # only `loaded`'s files moved on
    assert kv_geometry(other, kv_cache_config()).local_only is None
