"""What every other layer names: a donor's key and id (``keys.py``) and the identity its KV
belongs to (``identity.py``, with what a model's or adapter's files are: ``files.py``), and
safetensors files read without a memory map (``tensor_files.py``). Nothing here imports vLLM or
torch at import time (numpy, the standard library; lazily, huggingface_hub's cache lookup and
safetensors), nor any module of ours outside ``core``, so every layer above can use it without
an engine.
"""
