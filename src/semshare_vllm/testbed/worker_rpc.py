"""What a test runs in every worker process of a multi-process engine (tensor parallelism),
through ``LLM.collective_rpc(function, args=...)``: there the connector's worker half lives, one
per rank. vLLM calls each function with its worker first; they live in the package so that the
worker processes can import them by name.
"""

from __future__ import annotations

_recomputes: list[dict] | None = None  # this process's log, once ``record_recomputes`` ran


def _half():
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group().worker


def rank(worker) -> int:
    from semshare_vllm.vllm_compat import tensor_parallel

    return tensor_parallel.tp_rank()


def flush_captures(worker) -> dict:
    """Wait for this rank's captures in flight; its connector counters."""
    half = _half()
    half.flush_captures()
    return dict(half.stats.totals)


def drop_donor(worker, namespace: str, donor_id: str, only_rank: int) -> bool:
    """Rank ``only_rank`` loses a donor from its host store (the others keep it)."""
    from semshare_vllm.core.keys import DonorKey

    if rank(worker) != only_rank:
        return False
    half = _half()
    key = DonorKey(namespace, donor_id)
    held = key in half.kv.store
    half.kv.store.drop(key)
    return held


def record_recomputes(worker) -> None:
    """From now on, log every selective recompute this rank runs: the positions it kept to the
    last layer and how many it recomputed in each layer."""
    global _recomputes
    if _recomputes is not None:
        return
    from semshare_vllm.recompute.layer_runner import LayerRunner

    _recomputes = []
    original = LayerRunner.recompute

    def recompute(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        _recomputes.append(
            {"positions": result.positions.tolist(), "per_layer": list(result.per_layer)}
        )
        return result

    LayerRunner.recompute = recompute


def take_recomputes(worker) -> list[dict]:
    """The recomputes logged since the last take."""
    global _recomputes
    out, _recomputes = list(_recomputes or []), []
    return out
