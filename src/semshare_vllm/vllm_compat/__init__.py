"""The only modules that reach into vLLM's internals beyond the KV-connector API, one concern
each, with the vLLM versions they were written against (0.32 on CPU, 0.33 read from source).
When a vLLM release moves one of these, its module (and its test) is where it changes."""
