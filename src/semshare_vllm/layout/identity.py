"""What changes the KV of the same tokens at the same shape, as one JSON value (``kv_identity``)
that the fingerprint (``layout/geometry.py``) hashes.

- The weights: a local model's weight and code files by name, size and content digest (each
  file read once per version of it, ``core/file_digest.py``: equal mtimes say nothing), the
  content of its configuration files (``config.json``, ``params.json``, the quant
  method's own files such as ``hf_quant_config.json``, the processor's), or a hub snapshot's
  commit; how they are loaded (``load_format`` and the loader's options).
- The model definition vLLM built: the effective Hugging Face config (after
  ``--hf-config-path``, ``hf_overrides`` callables, Mistral's ``params.json``), the model
  implementation and class overrides, the dtype, quantisation (``quantization_config`` too),
  ``max_model_len`` (by which vLLM picks LongRoPE's factors), a sliding window turned off.
- The engine's multimodal processing and encoder settings, the speculative draft model, the KV
  cache dtype and the vLLM version.
- Any setting above that names a local file (``quantization_config_file``, a tensorizer file, an
  fp8 scale file) is keyed by that file's content.

Where nothing tells the weights from others (random weights, weights streamed from a URL or
another process, a hub id with no snapshot in the cache), ``unidentified_weights`` says why.

The weights' files can change while an engine starts (a trainer replacing ``latest``):
``vllm_compat/model_hook.py`` takes this identity just before the model loads, and the
fingerprint is of that one (``files_changed_since_load`` says when the files moved on).
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from types import SimpleNamespace

from semshare_vllm.core.file_digest import digest
from semshare_vllm.core.files import file_contents, file_sizes, hub_snapshot

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".index.json")
# A local model's own code (``trust_remote_code``) computes its KV as much as its weights do.
_MODEL_FILE_SUFFIXES = WEIGHT_SUFFIXES + (".py",)
# A trainer's files vLLM never loads (``filter_files_not_needed_for_inference``).
_TRAINER_FILES = frozenset(
    {"training_args.bin", "optimizer.bin", "optimizer.pt", "scheduler.pt", "scaler.pt"}
)
# Configuration files read by content: the model's (and Mistral's) config, the quant methods'
# own files (``get_config_filenames``: hf_quant_config.json, quantize_config.json,
# quant_config.json), the multimodal processor's. Not the tokenizer's: other token ids are
# other donors already.
_CONFIG_FILES = frozenset(
    {"config.json", "params.json", "preprocessor_config.json", "processor_config.json"}
)
# vLLM's load formats that read the weights from the files under ``model`` (vLLM 0.32 and 0.33
# LoadFormats). Any other (``dummy``, ``ipc_cache``, ``modelexpress``, a tensorizer URI, a
# loader registered by a plugin) takes them from elsewhere; so does ``npcache``, which reads a
# numpy copy it made once (``np/`` under the download directory) even after the files changed.
_FROM_MODEL_FILES = frozenset(
    {
        "auto",
        "hf",
        "safetensors",
        "pt",
        "fastsafetensors",
        "instanttensor",
        "mistral",
        "sharded_state",
        "runai_streamer",
        "runai_streamer_sharded",
    }
)
# ModelConfig fields that change what the model computes (the rest: tokenizer, sampling,
# serving, memory).
_MODEL_FIELDS = (
    "model",
    "model_weights",
    "runner",
    "convert",
    "dtype",
    "hf_config_path",
    "code_revision",  # (``revision`` is in the weights' identity, unless a commit names them)
    "quantization",
    "quantization_config",
    "hf_overrides",
    "model_class_overrides",
    "model_impl",
    "config_format",
    "disable_sliding_window",
)
# MultiModalConfig fields that only size caches, move tensors or skip profiling. Every other
# field is keyed, also one a later vLLM adds: an unknown knob costs sharing, never an answer.
_MM_RUNTIME_ONLY = frozenset(
    {
        "limit_per_prompt",
        "mm_processor_cache_gb",
        "mm_processor_cache_type",
        "mm_shm_cache_max_object_size_mb",
        "mm_tensor_ipc",
        "mm_ipc_gpu_memory_gb",
        "skip_mm_profiling",
        "mm_encoder_fp8_scale_save_path",
        "mm_encoder_fp8_scale_save_margin",
    }
)
_DRAFT_FIELDS = ("method", "model", "revision", "code_revision", "quantization")
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _stable(obj):
    """A JSON value for ``obj`` that is the same in every process (no object addresses)."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    if isinstance(obj, dict):
        return {str(k): _stable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        items = [_stable(v) for v in obj]
        return sorted(items, key=repr) if isinstance(obj, (set, frozenset)) else items
    if isinstance(obj, SimpleNamespace):
        return _stable(vars(obj))
    if callable(obj) and hasattr(obj, "__qualname__"):
        # named only: what it did is in the effective config (``hf_config``), keyed apart
        return f"{getattr(obj, '__module__', '?')}.{obj.__qualname__}"
    to_dict = getattr(obj, "to_dict", None)
    if callable(to_dict):
        try:
            return _stable(to_dict())
        except Exception:
            pass
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _stable(getattr(obj, f.name, None)) for f in dataclasses.fields(obj)}
    return _ADDRESS.sub("", repr(obj))


def _with_files(value):
    """``value`` (a ``_stable`` one) with every string that names a local file replaced by the
    name and that file's content digest: a setting pointing at a file is keyed by what it holds."""
    if isinstance(value, dict):
        return {k: _with_files(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_with_files(v) for v in value]
    # (a path: a separator or an extension; a bare word such as "auto" is no file name, even
    # where the working directory holds one)
    if isinstance(value, str) and 0 < len(value) < 4096 and (os.sep in value or "." in value):
        try:
            if os.path.isfile(value):
                return {"file": value, "content": digest(Path(value))}
        except (OSError, ValueError):
            pass
    return value


def _local_weights(path: Path) -> dict:
    """A local model's weight and code files (names, sizes, content digests) and its
    configuration files (content): another checkpoint at the same path changes it, whatever its
    files' names, sizes and mtimes. Files vLLM does not load are known by name and size
    (``unread_by_vllm``), not read in full: a trainer's, and ``.bin`` files beside safetensors
    (every load format we key takes safetensors first, or ``*.pt`` only: vLLM's
    ``DefaultModelLoader._prepare_weights``). ``.pt`` files are read (a model's own code may
    load one beside safetensors)."""
    unread: list[Path] = []
    if path.is_file():  # a single-file checkpoint (GGUF): its config, if any, beside it
        files = [path]
        configs = [c for c in [path.parent / "config.json"] if c.is_file()]
    else:
        names = sorted(p for p in path.iterdir() if p.is_file())
        files = [p for p in names if p.name.endswith(_MODEL_FILE_SUFFIXES)]
        configs = [
            p
            for p in names
            if p.name in _CONFIG_FILES or (p.suffix == ".json" and "quant" in p.name)
        ]
        # (vLLM globs ``*.safetensors``: a hidden one, ``._model.safetensors``, is none)
        safetensors = any(p.suffix == ".safetensors" and p.name[0] != "." for p in files)
        unread = [
            p for p in files if p.name in _TRAINER_FILES or (p.suffix == ".bin" and safetensors)
        ]
        files = [p for p in files if p not in unread]
    return {
        "files": file_contents(files),
        "configs": {p.name: digest(p) for p in configs},
        "unread_by_vllm": file_sizes(unread),
    }


def weights_identity(model_config, load_config=None) -> dict:
    """The weights' files as they are now (``_local_weights``), or a hub snapshot's commit."""
    model = str(getattr(model_config, "model", ""))
    revision = getattr(model_config, "revision", None)
    if os.path.exists(model):
        return _stable({"local": _local_weights(Path(model))})
    cache_dir = getattr(load_config, "download_dir", None)
    commit = hub_snapshot(model, revision, cache_dir)
    return {"hub": model, "commit": commit, "revision": None if commit else revision}


def _loader_options(load_config) -> dict:
    options = getattr(load_config, "model_loader_extra_config", None) or {}
    return options if isinstance(options, dict) else _stable(options)


def unidentified_weights(identity: dict, model_config, load_config=None) -> str | None:
    """Why ``identity`` (``kv_identity``'s) tells these weights from no other weights under the
    same name, or None. Then a fingerprint cannot key them: their donors stay in this process."""
    load_format = identity["load_format"]
    model = str(getattr(model_config, "model", ""))
    if load_format == "dummy":
        return "load_format 'dummy' computes with random weights"
    if load_format == "tensorizer":
        uri = str(_loader_options(load_config).get("tensorizer_uri") or "")
        if not os.path.isfile(uri):
            return (
                f"load_format 'tensorizer' reads the weights from {uri or 'a URI'}, whose "
                "version is not known here"
            )
    elif load_format not in _FROM_MODEL_FILES:
        return (
            f"load_format {load_format!r} takes the weights from elsewhere than {model} "
            "(another process, a peer, a loader we do not know): their version is not known here"
        )
    streamed = str(getattr(model_config, "model_weights", "") or "")
    if streamed and streamed != model:
        return f"the weights are streamed from {streamed}, whose version is not known here"
    draft = identity["settings"].get("draft") or {}
    if "weights" in draft and (
        draft["weights"] is None or draft["weights"].get("commit", 1) is None
    ):
        return "the speculative draft's weights are neither local files nor a cached hub snapshot"
    unread = _unread_file(identity)
    if unread is not None:
        return (
            f"{unread} could not be read here (or changed as it was read): its content is not known"
        )
    weights = identity["weights"]
    if "local" in weights:
        # (the files vLLM loads: a .bin beside safetensors comes with them, a trainer's is none)
        names = [name for name, _, _ in weights["local"]["files"]]
        if os.path.isdir(model) and not any(n.endswith(WEIGHT_SUFFIXES) for n in names):
            return f"no weight files in {model}"
        return None
    if weights["commit"] is None:
        return f"{model} is neither a local path nor a hub snapshot in the cache vLLM reads"
    return None


def _unread_file(identity: dict) -> str | None:
    """A file the identity names whose content could not be read (its digest None): the
    model's or the draft's weight and configuration files, a file a setting names. None if
    there is none."""
    draft = identity["settings"].get("draft") or {}
    for weights in (identity["weights"], draft.get("weights") or {}):
        local = weights.get("local") or {"files": [], "configs": {}}
        for name, _, content in local["files"]:
            if content is None:
                return name
        for name, content in local["configs"].items():
            if content is None:
                return name
    return _unread_setting_file(identity["settings"])


def _unread_setting_file(value) -> str | None:
    """In ``_with_files``'s output: a file named by a setting whose content is None."""
    if isinstance(value, dict):
        if value.keys() == {"file", "content"} and value["content"] is None:
            return str(value["file"])
        values = [v for k, v in value.items() if k != "weights"]  # (the draft's: above)
    elif isinstance(value, list):
        values = value
    else:
        return None
    for v in values:
        found = _unread_setting_file(v)
        if found is not None:
            return found
    return None


def files_changed_since_load(at_load: dict, model_config, load_config=None) -> bool:
    """Whether the model's files differ now from ``at_load`` (a ``kv_identity``)."""
    return weights_identity(model_config, load_config) != at_load["weights"]


def _hf_configs(model_config) -> dict:
    hf = getattr(model_config, "hf_config", None)
    text = getattr(model_config, "hf_text_config", None)
    return {"hf_config": _stable(hf), "hf_text_config": None if text is hf else _stable(text)}


def _multimodal(model_config):
    mm = getattr(model_config, "multimodal_config", None)
    if mm is None or not dataclasses.is_dataclass(mm):
        return _stable(mm)
    return {
        f.name: _stable(getattr(mm, f.name, None))
        for f in dataclasses.fields(mm)
        if f.name not in _MM_RUNTIME_ONLY
    }


def _draft(vllm_config):
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None:
        return None
    out = _with_files({name: _stable(getattr(spec, name, None)) for name in _DRAFT_FIELDS})
    draft = getattr(spec, "draft_model_config", None)
    if draft is not None and getattr(draft, "model", None):
        # (without a load config of its own, vLLM loads the draft with the target's)
        load_config = getattr(spec, "draft_load_config", None) or getattr(
            vllm_config, "load_config", None
        )
        try:
            out["weights"] = weights_identity(draft, load_config)
        except OSError:
            out["weights"] = None
    return out


def kv_identity(vllm_config) -> dict:
    """Everything the module docstring lists, as one JSON value."""
    import vllm

    mc = vllm_config.model_config
    load_config = getattr(vllm_config, "load_config", None)
    cache_config = getattr(vllm_config, "cache_config", None)
    settings = {
        "model": {name: _stable(getattr(mc, name, None)) for name in _MODEL_FIELDS},
        # vLLM picks LongRoPE's factors by the length the model is built with. Asked for as
        # "auto" (-1), it is fitted to the KV memory after the load, in the engine core's copy
        # first and the workers' later: keyed as asked. Any other is what the model was built
        # with (vLLM may lower it before, to a draft's: keyed as lowered).
        "max_model_len": _stable(
            -1
            if getattr(mc, "original_max_model_len", None) == -1
            else getattr(mc, "max_model_len", None)
        ),
        "loader": _stable(_loader_options(load_config)),
        "multimodal": _multimodal(mc),
    }
    return _stable(
        {
            "weights": weights_identity(mc, load_config),
            "load_format": str(getattr(load_config, "load_format", "auto") or "auto").lower(),
            # (the draft's file names are its identity's, never names of files here)
            "settings": {**_with_files(settings), "draft": _draft(vllm_config)},
            "definition": _hf_configs(mc),
            "vllm": getattr(vllm, "__version__", None),
            "cache_dtype": str(getattr(cache_config, "cache_dtype", None) or "auto"),
        }
    )
