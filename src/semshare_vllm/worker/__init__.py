"""The connector's worker half: ``SemShareWorker`` (``connector_worker.py``), the vLLM-facing
callbacks, over its parts: ``setup.py`` (what ``register_kv_caches`` checks and builds),
``capture.py``, ``loads.py``, ``repair.py``, ``tier.py`` (LMCache) and ``reports.py``."""

from semshare_vllm.worker.connector_worker import SemShareWorker

__all__ = ["SemShareWorker"]
