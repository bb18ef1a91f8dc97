"""``vllm_compat.model_hook`` on stand-in runner classes: runner modules imported later are
wrapped as they are imported, and only engines whose connector is ours are recorded; and the
runner modules it names exist in this vLLM."""

import sys
import types

from semshare_vllm.vllm_compat import model_hook


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
    monkeypatch.setattr(model_hook, "_PENDING", set())
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
