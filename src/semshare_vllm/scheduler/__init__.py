"""The connector's scheduler half: ``SemShareScheduler`` (``connector_scheduler.py``)."""

from semshare_vllm.scheduler.connector_scheduler import SemShareScheduler

__all__ = ["SemShareScheduler"]
