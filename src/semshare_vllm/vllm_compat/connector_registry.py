"""The connector registered by name in vLLM's KV-connector factory, so that
``{"kv_connector": "SemShareConnector"}`` works without ``kv_connector_module_path``.

Touches ``KVConnectorFactory`` (``vllm.distributed.kv_transfer.kv_connector.factory``):
``register_connector`` is public, but it raises for a name already registered, and vLLM runs the
plugin entry point more than once in some processes; so the private ``_registry`` dict is read
first. Written against vLLM 0.32; 0.33's factory has the same ``_registry`` and
``register_connector``.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("vllm.semshare.plugin")

CONNECTOR_NAME = "SemShareConnector"


def register_connector() -> None:
    """Register ``SemShareConnector`` (imported lazily, by vLLM) unless it is already. Never
    raises: with an incompatible vLLM, the module path still works."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        if CONNECTOR_NAME not in KVConnectorFactory._registry:
            KVConnectorFactory.register_connector(
                CONNECTOR_NAME, "semshare_vllm.connector", "SemShareConnector"
            )
    except Exception:  # an incompatible vLLM: the module path still works
        logger.warning("SemShare: could not register the connector by name", exc_info=True)
