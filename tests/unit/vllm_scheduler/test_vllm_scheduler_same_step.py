"""A repaired load behind vLLM's own prefix-cache hit, through vLLM's real scheduler: vLLM caches
a block when it allocates it, so a request scheduled in the same step can hit blocks whose KV
that step's forward writes. The repair runs before the forward (``start_load_kv``) and attends
over that prefix, so such a load is not run: its claim is reported failed and vLLM computes
those tokens once the prefix exists. Exact loads repaired with ``recompute_policy`` "all" stand
in for semantic ones (the same repair over the same prefix)."""

from support.tokens import random_id_list as ids
from support.vllm_engine_core import EngineCore, engine_config
from vllm.v1.outputs import KVConnectorOutput

from semshare_vllm.worker.reports import WorkerReport

BS = 16


def core_with_donor(max_batched_tokens: int = 8192):
    core = EngineCore(
        engine_config(
            prefix_caching=True,
            block_size=BS,
            max_batched_tokens=max_batched_tokens,
            extra={"recompute_policy": "all"},
        )
    )
    donor = core.add(core.request(ids(20 * BS + 5, 1)))
    core.step()
    core.capture(donor)
    core.scheduler.reset_prefix_cache()  # only the connector holds the donor
    return core, list(donor.prompt_token_ids)


def worker_reports(core, failed) -> KVConnectorOutput:
    """What our worker sends for a ``FailedLoad`` it was handed (``connector_worker.py``)."""
    report = WorkerReport(core.block_size)
    report.fail_load(failed.req_id, failed.block_ids, failed.start, failed.num_tokens)
    return KVConnectorOutput(invalid_block_ids=report.take_invalid_blocks())


def test_a_repair_behind_a_prefix_another_request_computes_in_the_same_step_is_not_run():
    core, donor = core_with_donor()
    shared = donor[: 6 * BS]
    a = core.add(core.request(shared + ids(40, 2), params={"semshare": "off"}))
    b = core.add(core.request(donor[: 18 * BS] + ids(30, 3)))
    out = core.schedule()
    assert out.num_scheduled_tokens[a.request_id] == len(a.prompt_token_ids)  # A: from 0
    b_blocks = core.block_ids(b.request_id)
    assert b_blocks[:6] == core.block_ids(a.request_id)[:6]  # B's hit: A's unwritten blocks
    meta = out.kv_connector_metadata
    assert not meta.loads  # not repaired over KV that does not exist yet
    (failed,) = meta.failed_loads
    assert (failed.req_id, failed.start, failed.num_tokens) == (b.request_id, 6 * BS, 12 * BS)
    assert core.ours.stats.totals["loads_behind_unwritten_prefix"] == 1

    core.answer(out, worker_reports(core, failed))
    assert b.num_computed_tokens == 6 * BS  # vLLM rewinds to the claim's first block
    out = core.step()  # A's prefix is written now: B computes the rest itself
    assert out.num_scheduled_tokens[b.request_id] == len(b.prompt_token_ids) - 6 * BS
    core.run_to_end(b)
    _, params = core.finished[b.request_id]
    assert params["semshare_provenance"]["load_failed"] is True
    core.run_to_end(a)
    core.connector.shutdown()


def test_a_repair_behind_a_prefix_written_in_an_earlier_step_runs():
    core, donor = core_with_donor()
    a = core.add(core.request(donor[: 6 * BS] + ids(40, 2), params={"semshare": "off"}))
    core.step()  # A's prompt is computed in this step's forward
    b = core.add(core.request(donor[: 18 * BS] + ids(30, 3)))
    out = core.schedule()
    (load,) = out.kv_connector_metadata.loads
    assert (load.req_id, load.dst_start, load.policy) == (b.request_id, 6 * BS, "all")
    assert not out.kv_connector_metadata.failed_loads
    assert core.ours.stats.totals.get("loads_behind_unwritten_prefix", 0) == 0
    core.answer(out)
    core.run_to_end(a)
    core.run_to_end(b)
    core.connector.shutdown()


def test_a_repair_behind_the_chunk_a_running_prefill_computes_in_the_same_step_is_not_run():
    """A's prompt is prefilled in chunks; B arrives between them and hits the blocks A's second
    chunk fills (A is a running request then: its blocks are not in the step's new blocks)."""
    core, donor = core_with_donor(max_batched_tokens=8 * BS)
    a = core.add(core.request(donor[: 12 * BS] + ids(8, 2), params={"semshare": "off"}))
    first = core.step()
    assert first.num_scheduled_tokens[a.request_id] == 8 * BS  # blocks 0-7 written
    b = core.add(core.request(donor[: 18 * BS] + ids(30, 3)))
    out = core.schedule()
    assert out.num_scheduled_tokens[a.request_id] == 4 * BS + 8  # blocks 8-11 filled now
    assert b.request_id in out.num_scheduled_tokens
    assert core.block_ids(b.request_id)[:12] == core.block_ids(a.request_id)[:12]
    meta = out.kv_connector_metadata
    assert not meta.loads
    (failed,) = meta.failed_loads
    assert (failed.req_id, failed.start) == (b.request_id, 12 * BS)
    core.answer(out, worker_reports(core, failed))
    core.run_to_end(a)
    core.run_to_end(b)
    core.connector.shutdown()


def test_a_request_behind_the_blocks_another_load_of_the_step_writes_waits_for_them():
    """A's exact load writes the blocks B's prefix-cache hit would take, in the worker, before
    B's repair would run; should it fail there, B would have attended over nothing. B is not
    scheduled until A's step has come back; then its repair runs over A's written blocks."""
    core, donor = core_with_donor()
    a = core.add(core.request(donor[: 10 * BS] + ids(40, 2)))
    b = core.add(core.request(donor[: 18 * BS] + ids(30, 3)))
    out = core.schedule()
    meta = out.kv_connector_metadata
    assert [(s.req_id, s.dst_start) for s in meta.loads] == [(a.request_id, 0)]
    assert b.request_id not in out.num_scheduled_tokens and not meta.failed_loads
    assert core.ours.stats.totals["waits_behind_unconfirmed_loads"] == 1
    core.answer(out)  # A's load ran
    out = core.step()
    assert core.block_ids(b.request_id)[:10] == core.block_ids(a.request_id)[:10]
    (load,) = out.kv_connector_metadata.loads
    assert (load.req_id, load.dst_start) == (b.request_id, 10 * BS)
    core.run_to_end(a)
    core.run_to_end(b)
    core.connector.shutdown()


def test_blocks_of_a_load_held_back_leave_vllms_prefix_cache_before_the_next_step():
    """With async scheduling the next step is scheduled before the held load's failure comes
    back: a request then must not take the held load's blocks (never written) as vLLM's hit."""
    core = EngineCore(
        engine_config(
            prefix_caching=True,
            block_size=BS,
            extra={"recompute_policy": "all"},
            async_scheduling=True,
        )
    )
    donor = core.add(core.request(ids(20 * BS + 5, 1)))
    core.capture(donor)
    core.scheduler.reset_prefix_cache()
    prompt = list(donor.prompt_token_ids)
    core.add(core.request(prompt[: 6 * BS] + ids(40, 2), params={"semshare": "off"}))
    b = core.add(core.request(prompt[: 18 * BS] + ids(30, 3)))
    held_step = core.schedule()
    (failed,) = held_step.kv_connector_metadata.failed_loads
    assert failed.req_id == b.request_id
    assert core.cached_hits(prompt[: 18 * BS] + ids(30, 4)) == 6 * BS  # A's blocks only
    c = core.add(core.request(prompt[: 18 * BS] + ids(30, 4)))
    next_step = core.schedule()  # before the held step's output
    assert core.block_ids(c.request_id)[6:18] != core.block_ids(b.request_id)[6:18]
    core.answer(held_step, worker_reports(core, failed))
    # vLLM computes the held claim itself; B's next step, scheduled before, runs over it: B is
    # preempted, that step's output dropped, and its prompt computed again (in_flight_failures)
    assert b.request_id in next_step.num_scheduled_tokens
    assert b.num_computed_tokens == 0 and b.num_preemptions == 1
    core.answer(next_step)
    assert b.num_output_tokens == 0
    for _ in range(30):
        if b.is_finished() and c.is_finished():
            break
        core.pipeline()
    core.drain()
    assert b.is_finished() and c.is_finished()
    core.connector.shutdown()
