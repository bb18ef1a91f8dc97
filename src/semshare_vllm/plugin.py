"""``vllm.general_plugins`` entry point: vLLM calls ``register()`` in every process it starts.

It registers the connector by name (``vllm_compat/connector_registry.py``), so
``{"kv_connector": "SemShareConnector"}`` works without ``kv_connector_module_path``, and installs
the model hook (``vllm_compat/model_hook.py``) that lets the worker reach the loaded model, and
the watch on weight updates (``vllm_compat/weight_updates.py``). It
must stay cheap and never raise: a plugin error would stop vLLM.
"""

from __future__ import annotations

from semshare_vllm.vllm_compat import connector_registry, model_hook, weight_updates


def register() -> None:
    connector_registry.register_connector()
    model_hook.install()
    weight_updates.install()
