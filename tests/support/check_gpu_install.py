"""What `make check-gpu-install` verifies in a venv installed from requirements/gpu.lock (the
[gpu] and [lmcache] extras: CUDA vLLM 0.33 and its torch), on any machine, GPU or not: the pins
install together, vLLM finds our plugin and connector, the model hook wraps every model runner
class vLLM ships, and every module of ours imports against this vLLM. Nothing runs on a GPU."""

import importlib
import pkgutil
import sys
from importlib.metadata import entry_points, version

import semshare_vllm
from semshare_vllm.vllm_compat import model_hook


def main() -> int:
    print("vllm", version("vllm"), "torch", version("torch"), "lmcache", version("lmcache"))
    plugins = [e.value for e in entry_points(group="vllm.general_plugins")]
    assert "semshare_vllm.plugin:register" in plugins, plugins
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from semshare_vllm.connector import SemShareConnector

    assert issubclass(SemShareConnector, KVConnectorBase_V1)
    model_hook.install()
    for module, name in model_hook.RUNNERS:
        cls = getattr(importlib.import_module(module), name)
        assert getattr(cls.load_model, "_semshare_wrapped", False), (module, name)
    print("runners wrapped:", ", ".join(model_hook.installed()))
    # testbed/ needs the test bed's data packages; bench/ needs matplotlib: not in the extra
    skipped = ("semshare_vllm.testbed", "semshare_vllm.bench")
    names = [
        m.name
        for m in pkgutil.walk_packages(semshare_vllm.__path__, "semshare_vllm.")
        if not m.name.startswith(skipped)
    ]
    for name in names:
        importlib.import_module(name)
    print(f"{len(names)} modules import")
    return 0


if __name__ == "__main__":
    sys.exit(main())
