"""``vllm_compat.weight_updates``: every weight-update call vLLM's worker has, and the loaded
model's ``load_weights``, count as an update (even when they raise: the weights may be half
written); on stand-ins, and on the installed vLLM's own worker class."""

import importlib
import inspect
import sys

import pytest

from semshare_vllm.vllm_compat import on_import, weight_updates


def test_the_models_load_weights_counts_each_call_even_one_that_raises():
    """Wrapped on the class that defines it: a copy of the model loads into itself, and the
    model still pickles (the second review's run: an instance wrapper did neither)."""
    import copy
    import pickle

    model = _Model()
    weight_updates.watch(model)
    weight_updates.watch(model)  # twice: wrapped once
    before = weight_updates.generation()
    assert model.load_weights([]) == {"w"}  # the original still answers
    assert weight_updates.generation() == before + 1
    with pytest.raises(ValueError):
        model.load_weights("bad")
    assert weight_updates.generation() == before + 2
    twin = copy.deepcopy(model)
    twin.load_weights([7])
    assert twin.loaded == [[], [7]] and model.loaded == [[]]
    assert weight_updates.generation() == before + 3
    assert pickle.loads(pickle.dumps(model)).loaded == [[]]
    assert "load_weights" not in vars(model)


class _Base:
    def load_weights(self, weights):
        if weights == "bad":
            raise ValueError("half written")
        self.loaded.append(weights)
        return {"w"}


class _Model(_Base):  # load_weights inherited: wrapped where it is defined
    def __init__(self):
        self.loaded = []


def test_a_model_without_load_weights_is_left_alone():
    class Model:
        pass

    weight_updates.watch(Model())  # no error


def test_the_worker_class_is_wrapped_when_its_module_is_imported_later(monkeypatch, tmp_path):
    module_name = "semshare_fake_worker_mod"
    (tmp_path / f"{module_name}.py").write_text(
        "class Worker:\n"
        "    def reload_weights(self, *a, **k):\n"
        "        return 'reloaded'\n"
        "    def update_weights(self, info):\n"
        "        return info\n"
        "    def finish_weight_update(self):\n"
        "        raise RuntimeError('no session')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(weight_updates, "WORKER", (module_name, "Worker"))
    monkeypatch.setattr(on_import, "_pending", {})
    finders = list(sys.meta_path)
    try:
        weight_updates.install()
        assert module_name not in sys.modules
        worker = __import__(module_name).Worker()
        before = weight_updates.generation()
        assert worker.reload_weights() == "reloaded"
        assert worker.update_weights({"x": 1}) == {"x": 1}
        with pytest.raises(RuntimeError):
            worker.finish_weight_update()
        assert weight_updates.generation() == before + 3
        weight_updates.install()  # again (the module is imported now): no double count
        worker.reload_weights()
        assert weight_updates.generation() == before + 4
    finally:
        sys.meta_path[:] = finders
        sys.modules.pop(module_name, None)


def test_vllms_worker_has_every_weight_update_call_and_each_is_wrapped():
    """A vLLM that renames one would let updates through it go unseen: named here. Its CPU
    worker inherits them (the class the CPU build runs)."""
    weight_updates.install()
    module = importlib.import_module(weight_updates.WORKER[0])
    cls = getattr(module, weight_updates.WORKER[1])
    for name in weight_updates.METHODS:
        method = cls.__dict__[name]
        assert getattr(method, "_semshare_counts_updates", False), name
        assert inspect.signature(method.__wrapped__).parameters  # the original, kept
    from vllm.v1.worker.cpu_worker import CPUWorker

    for name in weight_updates.METHODS:
        assert name not in CPUWorker.__dict__, name  # inherited: the wrapped one runs
