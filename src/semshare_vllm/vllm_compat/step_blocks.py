"""Which blocks a step's forward pass fills, read from vLLM's ``SchedulerOutput``.

vLLM caches a request's full blocks for reuse when it allocates them, before the forward pass
that writes them, so a request scheduled later in the same step can get them as its own
prefix-cache hit (vLLM's own attention is right: each layer writes the step's KV before it
reads). A repair runs in ``start_load_kv``, before that forward, and must not attend over them.

Written against vLLM 0.32 and 0.33: ``scheduled_new_reqs`` (``block_ids``,
``num_computed_tokens`` before the step), ``scheduled_cached_reqs`` (``req_ids``,
``num_computed_tokens``), ``num_scheduled_tokens``, and the cache manager's ``get_block_ids``
(a running request's step may fill a block it was given in an earlier step). The connector's
metadata is built before vLLM advances ``num_computed_tokens`` for the step.
"""

from __future__ import annotations


def blocks_filled_in_step(scheduler_output, kv_cache_manager, block_size: int) -> set[int] | None:
    """Ids of the blocks (first KV-cache group) whose last slot this step's forward writes;
    None where a running request's blocks cannot be read (no cache manager)."""
    scheduled = scheduler_output.num_scheduled_tokens
    filled: set[int] = set()

    def add(req_id: str, block_ids, computed: int) -> None:
        n = scheduled.get(req_id, 0)
        # blocks full after the step whose last slot the step writes: computed // bs onwards
        filled.update(block_ids[computed // block_size : (computed + n) // block_size])

    for new in scheduler_output.scheduled_new_reqs:
        add(new.req_id, new.block_ids[0], new.num_computed_tokens)
    cached = scheduler_output.scheduled_cached_reqs
    if cached.req_ids and kv_cache_manager is None:
        return None
    for req_id, computed in zip(cached.req_ids, cached.num_computed_tokens):
        add(req_id, kv_cache_manager.get_block_ids(req_id)[0], computed)
    return filled


def start_before_forward(scheduler_output) -> None:
    """Have the runners call the connector's ``start_load_kv`` before this step's forward.
    vLLM's runners (0.32 and 0.33: the V1 mixin, the V2 ``post_forward``) call it after the
    forward unless ``SchedulerOutput.has_sync_kv_loads`` is set, which vLLM sets only for steps
    with connector loads; work of ours that must precede the forward sets it too."""
    scheduler_output.has_sync_kv_loads = True
