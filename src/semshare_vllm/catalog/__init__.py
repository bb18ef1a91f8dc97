"""The scheduler's catalog of donors: ``donor_index.py`` (what exists, per namespace, its
prefixes, byte accounting), ``eviction.py`` (which donor leaves when the store is full) and
``shared_index.py`` (the donor records shared across instances through Redis), whose record format
and signatures are ``shared_records.py``. No vLLM import.
"""
