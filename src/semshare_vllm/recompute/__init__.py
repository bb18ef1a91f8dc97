"""Selective recompute inside vLLM: repair what reused donor KV gets wrong.

``model_hook.py`` (reach the model through a ``vllm.general_plugins`` hook), ``layer_runner.py``
(recompute chosen positions of a request layer by layer over its paged, blended KV).
"""
