"""What every other layer names: a donor's key and id (``keys.py``) and the identity its KV
belongs to (``identity.py``, with what a model's or adapter's files are: ``files.py``). Nothing
here imports vLLM or torch (numpy, the standard library and, lazily, huggingface_hub's cache
lookup only), nor any module of ours outside ``core``, so every layer above can use it without
an engine.
"""
