"""``vllm_compat.model_hook`` on stand-in runner classes: runner modules imported later are
wrapped as they are imported, and only engines whose connector is ours are recorded; and on the
installed vLLM's own runner classes: every one with a ``load_model`` is named, and wrapped."""

import ast
import importlib
import importlib.util
import sys
import types
from pathlib import Path

from semshare_vllm.vllm_compat import model_hook, on_import, weight_updates


class _Config:
    def __init__(self, connector):
        self.kv_transfer_config = (
            None
            if connector is None
            else types.SimpleNamespace(kv_connector=connector, kv_connector_module_path=None)
        )


def test_hook_wraps_runner_classes_imported_later_and_records_only_our_engines(
    monkeypatch, tmp_path
):
    module_name = "semshare_fake_runner_mod"
    (tmp_path / f"{module_name}.py").write_text(
        "class FakeRunner:\n"
        "    def __init__(self, config):\n"
        "        self.vllm_config = config\n"
        "    def load_model(self):\n"
        "        self.model = type('Model', (), {})()\n"
        "        return 'loaded'\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(model_hook, "RUNNERS", ((module_name, "FakeRunner"),))
    monkeypatch.setattr(model_hook, "_models", __import__("weakref").WeakValueDictionary())
    monkeypatch.setattr(model_hook, "_runners", __import__("weakref").WeakValueDictionary())
    monkeypatch.setattr(model_hook, "_installed", [])
    monkeypatch.setattr(on_import, "_pending", {})
    finders = list(sys.meta_path)
    try:
        model_hook.install()  # the module is not imported yet
        assert module_name not in sys.modules
        mod = __import__(module_name)  # ...wrapped as it is imported
        assert model_hook.installed() == [f"{module_name}.FakeRunner"]
        other = mod.FakeRunner(_Config("SomeOtherConnector"))
        assert other.load_model() == "loaded"  # the original still runs
        assert model_hook.loaded_model(other.vllm_config) is None
        ours = mod.FakeRunner(_Config("SemShareConnector"))
        ours.load_model()
        assert model_hook.loaded_model(ours.vllm_config) is ours.model
        assert model_hook.loaded_runner(ours.vllm_config) is ours
        model_hook.install()  # twice: no double wrap
        assert mod.FakeRunner.load_model.__wrapped__.__name__ == "load_model"
        assert not getattr(mod.FakeRunner.load_model.__wrapped__, "_semshare_wrapped", False)
    finally:
        sys.meta_path[:] = finders
        sys.modules.pop(module_name, None)


def test_the_runner_modules_the_hook_wraps_exist_in_this_vllm():
    """A vLLM that moves a runner module would leave recompute silently off: name it here."""
    import importlib.util

    for module_name, _ in model_hook.RUNNERS:
        assert importlib.util.find_spec(module_name) is not None, module_name


def test_a_model_inside_vllms_cuda_graph_wrapper_is_recorded_unwrapped(monkeypatch):
    """Issue 19, item 2: V1's GPU runner keeps its model inside ``CUDAGraphWrapper`` (its own
    ``get_model()`` unwraps it); the hook recorded the wrapper, which the layer runner refuses
    by class, so recompute was always off there. Built without a GPU: the wrapper's
    constructor needs CUDA graphs, its ``unwrap`` does not."""
    import weakref

    from vllm.compilation.cuda_graph import CUDAGraphWrapper

    class Model:
        pass

    model = Model()
    wrapper = object.__new__(CUDAGraphWrapper)
    wrapper.runnable = model

    class Runner:
        def __init__(self):
            self.vllm_config = _Config("SemShareConnector")

        def load_model(self):
            self.model = wrapper

    monkeypatch.setattr(model_hook, "_models", weakref.WeakValueDictionary())
    monkeypatch.setattr(model_hook, "_runners", weakref.WeakValueDictionary())
    assert model_hook._wrap(Runner)
    runner = Runner()
    runner.load_model()
    assert model_hook.loaded_model(runner.vllm_config) is model


# ---- the runner classes of the installed vLLM ----------------------------------------------
# Read from its source (ast), so that runners whose modules cannot import here (a GPU runner
# under another torch) are checked too; then imported and wrapped where they do import.


def _runner_classes():
    """{(module, class): ClassDef} of every ``*ModelRunner`` class in vLLM's ``v1/worker``."""
    root = Path(next(iter(importlib.util.find_spec("vllm.v1.worker").submodule_search_locations)))
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        module = ".".join(
            ("vllm.v1.worker",) + parts[:-1] + (() if parts[-1] == "__init__" else parts[-1:])
        )
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and node.name.endswith("ModelRunner"):
                found[(module, node.name)] = node
    return found


def _load_model(node):
    return next(
        (f for f in node.body if isinstance(f, ast.FunctionDef) and f.name == "load_model"), None
    )


def _sets_self_model(func) -> bool:
    return any(
        isinstance(t, ast.Attribute)
        and t.attr == "model"
        and isinstance(t.value, ast.Name)
        and t.value.id == "self"
        for node in ast.walk(func)
        if isinstance(node, (ast.Assign, ast.AnnAssign))
        for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
    )


def test_every_runner_class_that_loads_a_model_is_named_and_sets_its_model_there():
    """A runner vLLM adds (or moves) with its own ``load_model`` would load models the hook
    never sees: recompute silently off. Each one named must set ``self.model`` in it (what the
    hook records), or inherit it from one named that does."""
    classes = _runner_classes()
    loaders = {key for key, node in classes.items() if _load_model(node) is not None}
    assert loaders and loaders <= set(model_hook.RUNNERS), loaders - set(model_hook.RUNNERS)
    for key in model_hook.RUNNERS:
        node = classes.get(key)
        if node is None:  # a build without this runner (the hook skips it)
            continue
        func = _load_model(node)
        if func is None:  # inherits: from a runner named here (by its class name)
            bases = {b.id for b in node.bases if hasattr(b, "id")}
            assert bases & {name for (_, name) in loaders}, key
            continue
        assert _sets_self_model(func), key
    present = [key for key in model_hook.RUNNERS if key in classes]
    assert ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner") in present
    assert ("vllm.v1.worker.cpu_model_runner", "CPUModelRunner") in present


def test_the_hook_wraps_every_real_runner_class_that_imports_here():
    finders = list(sys.meta_path)
    imported = []
    try:
        model_hook.install()
        for module_name, class_name in _runner_classes():
            try:
                module = importlib.import_module(module_name)
            except Exception:  # e.g. a GPU or XPU runner needing what this build lacks
                continue
            cls = getattr(module, class_name)
            imported.append(f"{module_name}.{class_name}")
            assert getattr(cls.load_model, "_semshare_wrapped", False), imported[-1]
    finally:
        sys.meta_path[:] = finders
    assert "vllm.v1.worker.gpu_model_runner.GPUModelRunner" in imported
    assert "vllm.v1.worker.cpu_model_runner.CPUModelRunner" in imported


def test_a_model_loaded_again_for_the_engine_counts_as_a_weight_update(monkeypatch):
    """A runner that loads a model again (another object) may have loaded other weights, and
    its own ``reload_weights`` may copy into the parameters without ``load_weights``: the
    worker must drop the donors of before (``weight_updates``). The same model recorded twice
    (a runner's ``load_model`` calling its base class's) is no update."""
    import weakref

    monkeypatch.setattr(model_hook, "_models", weakref.WeakValueDictionary())
    monkeypatch.setattr(model_hook, "_runners", weakref.WeakValueDictionary())
    monkeypatch.setattr(model_hook, "_loads", {})

    class Model:
        def load_weights(self, weights):
            return set()

    class Runner:
        def __init__(self):
            self.vllm_config = _Config("SemShareConnector")

        def load_model(self):
            self.model = Model()

        def reload_weights(self, **kwargs):  # may copy into the parameters itself
            return "reloaded"

    class Again(Runner):
        def load_model(self):
            super().load_model()

    assert model_hook._wrap(Runner) and model_hook._wrap(Again)
    runner = Again()
    before = weight_updates.generation()
    runner.load_model()  # both wrappers record the same model
    assert weight_updates.generation() == before
    runner.model.load_weights([])  # watched
    assert weight_updates.generation() == before + 1
    runner.load_model()  # another model object
    assert weight_updates.generation() == before + 2
    assert runner.reload_weights(weights_path="x") == "reloaded"
    assert weight_updates.generation() == before + 3
