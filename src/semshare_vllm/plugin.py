"""``vllm.general_plugins`` entry point: vLLM calls ``register()`` in every process it starts.

It registers the connector by name, so ``{"kv_connector": "SemShareConnector"}`` works without
``kv_connector_module_path``, and installs the model hook (``recompute/model_hook.py``) that lets
the worker reach the loaded model. It must stay cheap and never raise: a plugin error would stop
vLLM.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("vllm.semshare.plugin")


def register() -> None:
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        if "SemShareConnector" not in KVConnectorFactory._registry:
            KVConnectorFactory.register_connector(
                "SemShareConnector", "semshare_vllm.connector", "SemShareConnector")
    except Exception:  # an incompatible vLLM: the module path still works
        logger.warning("SemShare: could not register the connector by name", exc_info=True)
    from semshare_vllm.recompute import model_hook

    model_hook.install()
