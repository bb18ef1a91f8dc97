"""Token alignment: which donor token each target token takes its KV from.

``result.py`` (the ``Alignment`` value every stage fills in), ``exact_runs.py`` (token-identical
runs at any offset). The fuzzy (SemShareKV LSH) and sentence-unit stages follow.
"""
