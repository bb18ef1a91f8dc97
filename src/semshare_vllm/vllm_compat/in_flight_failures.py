"""A load that failed while the request's next step was already in flight: vLLM preempts it.

With two steps in flight (async scheduling, CUDA's default in vLLM 0.32 and 0.33), the step after
a load's is scheduled before the load's output comes back. When that output reports the load
failed (``invalid_block_ids``: a donor unreadable, a repair the gate declined, a load held back),
vLLM rewinds the request to its first failed block (``_update_requests_with_invalid_blocks``)
and skips that step's token, but the next step, already running, decodes over the blocks the
load never wrote, from the token sampled over them. vLLM delivers that step's token to the
client, and its model runner puts it in place of the recomputed prompt's last token (a request
of the previous batch gets its sampled token as its last input, ``_prepare_input_ids``): a wrong
answer with no error.

vLLM's own preemption with ``drop_stale_output`` (what its prefix-cache reset does to running
requests) covers every part of that: it drops the output of each step in flight for the
request, clears its output placeholders, frees its blocks once those steps end, and has the
runner forget the request (the V1 runner drops a resumed request from its batch, the V2 one
each of ``preempted_req_ids``), which is then computed again from its prompt (vLLM's prefix
cache serves what stays valid). Its blocks from the first failed one on leave that cache first,
including those the step in flight fills (a next prefill chunk computed over the failed load,
cached under its true hashes when allocated). ``install`` wraps
``Scheduler._handle_invalid_blocks``, which ``update_from_output`` calls before its loop over the
step's requests, to preempt so each running request it rewound that has a later step in flight.
Engines whose connector is not ours, and vLLM's "fail" policy (the request ends with an error),
are left as they are; with one step in flight nothing changes.

Touches ``Scheduler._handle_invalid_blocks``, ``Scheduler._preempt_request``, ``.running``,
``.requests``, ``.prev_step_scheduled_req_ids``, ``.block_size`` and ``.kv_cache_manager``
(``get_block_ids``, ``evict_blocks``), and ``Request.num_in_flight_tokens``: the same in vLLM
0.32 and 0.33.
"""

from __future__ import annotations

import functools
import logging
import time

from semshare_vllm.vllm_compat import block_hashes, model_hook

logger = logging.getLogger("vllm.semshare.scheduler")


def install() -> None:
    """Wrap vLLM's ``Scheduler._handle_invalid_blocks`` (once; the scheduler-side connector
    calls this when built). Never raises: without it a failed load behaves as in vLLM."""
    try:
        from vllm.v1.core.sched.scheduler import Scheduler

        original = Scheduler.__dict__.get("_handle_invalid_blocks")
        if original is None or getattr(original, "_semshare_wrapped", False):
            return

        @functools.wraps(original)
        def _handle_invalid_blocks(self, invalid_block_ids, num_scheduled_tokens):
            skipped = original(self, invalid_block_ids, num_scheduled_tokens)
            try:
                if self.recompute_kv_load_failures and model_hook.ours_anywhere(self.vllm_config):
                    preempted = preempt_in_flight(self, skipped, num_scheduled_tokens)
                    ours = getattr(self.connector, "scheduler", None)  # (not in a MultiConnector)
                    if preempted and hasattr(ours, "stats"):
                        ours.stats.add("failed_loads_preempted", preempted)
            except Exception:  # never into vLLM's output handling: vLLM's rewind stands
                logger.error(
                    "SemShare: could not preempt a request whose failed load its next step "
                    "already ran over",
                    exc_info=True,
                )
            return skipped

        _handle_invalid_blocks._semshare_wrapped = True
        Scheduler._handle_invalid_blocks = _handle_invalid_blocks
    except Exception:
        logger.warning(
            "SemShare: cannot watch vLLM's failed loads under async scheduling", exc_info=True
        )


def preempt_in_flight(scheduler, rewound: set[str], num_scheduled_tokens: dict[str, int]) -> int:
    """Preempt, dropping their in-flight output, the running requests of ``rewound`` (those a
    failed load rewound, which vLLM skips in this output) with a step in flight after this
    output's; how many."""
    from vllm.v1.request import RequestStatus

    # (this output's step is still counted in flight: anything beyond it runs later steps)
    chosen = [
        r
        for r in scheduler.running
        if r.request_id in rewound
        and r.status == RequestStatus.RUNNING
        and r.num_in_flight_tokens > num_scheduled_tokens.get(r.request_id, 0)
    ]
    # last first, as vLLM's reset does: each goes to the front of the queue, so they keep
    # their order there
    for request in reversed(chosen):
        # Its blocks from the first failed one on leave vLLM's prefix cache, the ones the step
        # in flight fills too (a next prefill chunk's, cached under their true hashes when
        # allocated, computed over the failed load): the scheduler half's watch knows only
        # the blocks of the load's step, and these are freed below with their hashes.
        blocks = scheduler.kv_cache_manager.get_block_ids(request.request_id)[0]
        first = request.num_computed_tokens // scheduler.block_size  # (vLLM's rewind)
        block_hashes.evict_cached(scheduler.kv_cache_manager, list(blocks[first:]))
        scheduler._preempt_request(request, time.monotonic(), drop_stale_output=True)
        scheduler.running.remove(request)  # (after: a preemption that raised leaves it running)
        # Resumed as soon as the next step: it must not count as scheduled in the last one
        # (vLLM's reset clears the same set), else the V1 runner, which drops a resumed
        # request from its batch, gets none of its tokens back.
        scheduler.prev_step_scheduled_req_ids.discard(request.request_id)
    preempted = len(chosen)
    if preempted:
        logger.info(
            "SemShare: %d request(s) preempted after a failed load: their next step was "
            "already running over the blocks the load never wrote (its output is dropped)",
            preempted,
        )
    return preempted
