"""Where donor KV is kept: ``base.py`` (the ``DonorKVStore`` interface), ``host_store.py`` (the
worker's host-memory page pool), ``lmcache_store.py`` (LMCache: the only module importing it) and
``donor_file.py`` (the on-disk format of a persisted donor). No vLLM import.
"""
