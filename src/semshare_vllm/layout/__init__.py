"""Where KV sits and what it is: ``geometry.py`` (what the connector needs from vLLM's KV-cache
config, and the fingerprint of persisted donors), ``specs/`` (one ``PageSpec`` per attention
backend's page layout: K/V offsets for the kernels, reads, writes and copies for everything
else) and ``paged_cache.py`` (slot numbers and layer stacks, the same for every layout).
"""
