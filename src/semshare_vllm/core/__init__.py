"""What every other layer names: a donor's key and id (``keys.py``) and the identity its KV
belongs to (``identity.py``). Nothing here imports vLLM or torch (numpy and the standard
library only), nor any other module of ours, so every layer above can use it without an engine.
"""
