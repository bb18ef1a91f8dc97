"""Where KV sits and what it is: ``geometry.py`` (what the connector needs from vLLM's KV-cache
config, and the fingerprint of persisted donors) and ``kv_layout.py`` ((K, V) access to each
attention backend's page layout).
"""
