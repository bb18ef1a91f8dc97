"""Donor discovery: embed a prompt, find the most similar donors of its namespace.

``embedder.py`` (MiniLM over the whole prompt, in overlapping windows), ``vector_index.py``
(cosine top-k per namespace: exact numpy search, FAISS beyond a size), ``simhash.py`` (a cheap
near-duplicate fingerprint), ``service.py`` (all of it on one background thread, so vLLM's
scheduler never waits on it), ``snapshot.py`` (the index on disk beside the donors).
"""
