"""Test bed helpers: offline models, real text and a `vllm serve` process, for tests and benchmarks.

Nothing here is imported by the connector itself.
"""
