"""The connector registered by name in vLLM's KV-connector factory, so that
``{"kv_connector": "SemShareConnector"}`` works without ``kv_connector_module_path``; and
whether it is the engine's connector or one of a ``MultiConnector``'s (``serves_alone``).

Touches ``KVConnectorFactory`` (``vllm.distributed.kv_transfer.kv_connector.factory``):
``register_connector`` is public, but it raises for a name already registered, and vLLM runs the
plugin entry point more than once in some processes; so the private ``_registry`` dict is read
first. Written against vLLM 0.32; 0.33's factory has the same ``_registry`` and
``register_connector``. ``serves_alone`` reads the worker's KV-transfer group
(``vllm.distributed.kv_transfer.get_kv_transfer_group``, the same in both).
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


def serves_alone(connector) -> bool:
    """Whether ``connector`` is this worker's KV connector itself, not one of a
    ``MultiConnector``'s: that one hands every connector the first metadata any of them gives
    in vLLM's start-up handshake, so ours would reach (and fail) another's, e.g. NIXL's."""
    try:
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        return has_kv_transfer_group() and get_kv_transfer_group() is connector
    except Exception:
        return False
