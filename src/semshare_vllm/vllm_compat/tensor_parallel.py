"""The tensor-parallel group, from vLLM's parallel state: this worker's rank (which KV shard it
holds, stores and checks), and the two agreements the ranks must reach so that a load runs the
same way on every one of them.

Under tensor parallelism each rank holds some of the KV heads, and a selective recompute runs the
model's row-parallel layers, whose all-reduce sums every rank's share of the *same* tokens. So:

* ``all_reduce_scores``: the per-position scores a recompute policy ranks (K/V deviation, the
  attention paid) are summed over the group before any rank chooses, so that every rank chooses
  the same positions, as many of them. A sum, not a max: both scores are sums over KV or query
  heads, and summing each rank's heads gives exactly the score a single rank holding all heads
  computes (the deviation's numerator and denominator are summed apart, then divided), so the
  choice is the one TP=1 makes.
* ``all_agree``: a load (or its repair) that failed on one rank fails on all (a minimum of the
  ranks' ok flags), so every rank reports the same blocks and none runs a repair whose
  collectives the others never enter.

Both run on the group's CPU (gloo) communicator: the scores are read on the host anyway, the
result is bit-identical on every rank, and vLLM's device communicators (NCCL, custom all-reduce)
are left to the model. With one rank, or no group (tools and tests outside an engine), both
return their input and communicate nothing.

``get_tensor_model_parallel_rank`` and ``get_tp_group`` are the functions vLLM's own connectors
call; the group exists in every worker process by ``register_kv_caches``. Written against vLLM
0.32 (CPU); 0.33's ``GroupCoordinator`` has the same ``world_size`` and ``cpu_group``.
"""

from __future__ import annotations

import torch


def tp_rank() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank()


def _cpu_group():
    """The group's gloo communicator, or None with one rank (or no group): nothing to agree."""
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    group = parallel_state.get_tp_group()
    return group.cpu_group if group.world_size > 1 else None


def all_reduce_scores(scores: torch.Tensor) -> torch.Tensor:
    """``scores`` (1-D, any device) summed over the tensor-parallel group, on the host (fp32)."""
    out = scores.detach().to("cpu", torch.float32)
    group = _cpu_group()
    if group is not None:
        out = out.contiguous()
        torch.distributed.all_reduce(out, group=group)
    return out


def all_agree(ok: bool) -> bool:
    """True only where every rank of the group passed True. Every rank must call it, in the same
    order as the others: it is a collective."""
    group = _cpu_group()
    if group is None:
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=group)
    return bool(flag.item())
