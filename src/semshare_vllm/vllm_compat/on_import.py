"""Run code on a vLLM module once it is imported: at once if it already is, else right after
its first import. Processes that never import the module (the API server never imports a model
runner) never pay for importing it. Used by the hooks that wrap vLLM's classes
(``model_hook``, ``weight_updates``); imports nothing of vLLM's.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
import threading
from types import ModuleType
from typing import Callable

logger = logging.getLogger("vllm.semshare")

_lock = threading.Lock()
_pending: dict[str, list[Callable[[ModuleType], None]]] = {}


def when_imported(module_name: str, callback: Callable[[ModuleType], None]) -> None:
    """Call ``callback(module)`` once the module is imported. A callback that raises is
    logged, never raised into the import."""
    module = sys.modules.get(module_name)
    if module is not None:
        _run(callback, module)
        return
    with _lock:
        callbacks = _pending.setdefault(module_name, [])
        if callback not in callbacks:  # installs run more than once (plugin, worker half)
            callbacks.append(callback)
        if not any(isinstance(f, _RunOnImport) for f in sys.meta_path):
            sys.meta_path.insert(0, _RunOnImport())


def _run(callback, module) -> None:
    try:
        callback(module)
    except Exception:
        logger.warning("SemShare: a hook on %s failed", module.__name__, exc_info=True)


class _RunOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in _pending:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None:
            return None
        exec_module = spec.loader.exec_module

        def exec_and_run(module):
            exec_module(module)
            with _lock:
                callbacks = _pending.pop(fullname, [])
            for callback in callbacks:
                _run(callback, module)

        spec.loader.exec_module = exec_and_run
        return spec
