"""Selective recompute inside vLLM: repair what reused donor KV gets wrong.

``layer_runner.py`` (recompute chosen positions of a request layer by layer over its paged,
blended KV, on the model ``vllm_compat/model_hook.py`` recorded), ``policy.py`` (which positions).
"""
