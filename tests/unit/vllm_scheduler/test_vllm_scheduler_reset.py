"""vLLM's ``reset_prefix_cache(reset_connector=True)``, which its pause and sleep call (and
reinforcement-learning loops around a weight update), through vLLM's real scheduler: no donor
of before is offered again, the worker is told to drop them all, and the connector goes on
serving the donors captured after it."""

from support.tokens import random_id_list as ids
from support.vllm_engine_core import EngineCore, engine_config
from vllm.v1.outputs import KVConnectorOutput


def test_a_connector_reset_forgets_every_donor_and_the_next_ones_serve():
    core = EngineCore(engine_config(prefix_caching=True))
    bs = core.block_size
    donor = core.add(core.request(ids(10 * bs + 5, 1)))
    core.step()
    core.capture(donor)
    assert core.scheduler.reset_prefix_cache(reset_connector=True)
    assert core.ours.stats.totals["connector_resets"] == 1

    prompt = list(donor.prompt_token_ids[: 7 * bs + 3]) + ids(40, 2)
    target = core.add(core.request(prompt))
    out = core.step()
    meta = out.kv_connector_metadata
    assert meta.reset  # the worker drops its copies before anything else
    assert not meta.loads and out.num_scheduled_tokens[target.request_id] == len(prompt)
    assert core.ours.geometry.local_only  # nothing persisted or shared from now on
    key = core.capture(target).key
    assert not core.step().kv_connector_metadata.reset  # said once

    core.scheduler.reset_prefix_cache()  # vLLM's own copy of target gone: only ours is left
    again = core.add(core.request(prompt[: 6 * bs] + ids(20, 3)))
    out = core.step()
    (load,) = out.kv_connector_metadata.loads
    assert load.key == key and load.num_tokens == 6 * bs
    core.run_to_end(again)
    core.connector.shutdown()


def test_a_pause_with_a_capture_pending_resets_both_caches():
    """vLLM's pause and sleep (``_reset_caches``) reset its prefix cache with
    ``reset_running_requests``, and raise where a block is still in use: an in-process engine
    (offline ``LLM``) pauses right after ``generate`` returned, while the blocks of its last
    request are held for our capture. On main this raised, and neither cache was reset. The
    blocks are given back first; the worker then drops the capture with everything else."""
    core = EngineCore(engine_config(prefix_caching=True))
    bs = core.block_size
    donor = core.add(core.request(ids(6 * bs + 5, 9)))
    core.run_to_end(donor)
    assert core.connector.has_pending_block_frees()
    assert core.scheduler.reset_prefix_cache(reset_running_requests=True, reset_connector=True)
    assert core.free_blocks() == core.num_blocks - 1  # vLLM's reset found every block free

    out = core.step()
    meta = out.kv_connector_metadata
    assert meta.reset and meta.captures_released and out.has_sync_kv_loads
    assert [c.req_id for c in meta.captures] == [donor.request_id]
    core.step(KVConnectorOutput(finished_sending={donor.request_id}))  # freed twice: no-op
    core.assert_empty()
    assert len(core.ours.index) == 0

    target = core.add(core.request(list(donor.prompt_token_ids) + ids(10, 5)))
    out = core.step()
    assert not out.kv_connector_metadata.loads
    assert out.num_scheduled_tokens[target.request_id] == target.num_prompt_tokens
    core.run_to_end(target)
    core.connector.shutdown()


def test_a_plain_reset_with_a_capture_pending_succeeds_and_the_donor_is_kept():
    """``reset_prefix_cache()`` alone (vLLM's cache only, as benchmarks and training loops call
    it) right after a request finished: on main it failed (our capture held blocks), so vLLM's
    own cache kept its blocks. Now it succeeds; the worker copies the donor before the step
    writes anything into the blocks given back, and the donor serves as before."""
    core = EngineCore(engine_config(prefix_caching=True))
    bs = core.block_size
    donor = core.add(core.request(ids(6 * bs + 5, 10)))
    core.run_to_end(donor)
    assert core.scheduler.reset_prefix_cache()
    assert core.free_blocks() == core.num_blocks - 1

    out = core.step()
    meta = out.kv_connector_metadata
    assert not meta.reset and meta.captures_released
    # no load in the step, yet the worker must copy before the forward writes (vLLM's runners
    # call start_load_kv after the forward unless this is set: the auditor's run served a donor
    # whose blocks a new request's forward had overwritten)
    assert out.has_sync_kv_loads
    (spec,) = meta.captures
    core.step(KVConnectorOutput(finished_sending={donor.request_id}))
    core.assert_empty()

    target = core.add(core.request(list(donor.prompt_token_ids) + ids(10, 11)))
    out = core.step()
    (load,) = out.kv_connector_metadata.loads
    assert load.key == spec.key and load.num_tokens == 6 * bs
    assert not out.kv_connector_metadata.captures_released  # said once
    core.run_to_end(target)
    core.connector.shutdown()


def test_a_request_finished_between_a_reset_and_its_step_is_no_donor():
    """Its KV was computed before the reset, and the worker drops that step's captures: kept,
    the scheduler would have offered a donor no worker holds (the reviewer's run)."""
    from vllm.v1.request import RequestStatus

    core = EngineCore(engine_config(prefix_caching=True))
    bs = core.block_size
    running = core.add(core.request(ids(6 * bs + 5, 12), max_tokens=20))
    core.step()
    core.step()
    assert not core.scheduler.reset_prefix_cache(reset_connector=True)  # vLLM: blocks in use
    core.scheduler.finish_requests(running.request_id, RequestStatus.FINISHED_ABORTED)
    assert core.finished[running.request_id][0] is False  # its blocks freed at once
    assert len(core.ours.index) == 0
    out = core.step()
    assert out.kv_connector_metadata.reset and not out.kv_connector_metadata.captures
    core.assert_empty()
    core.connector.shutdown()


def test_blocks_given_back_are_copied_first_even_if_a_release_fails(monkeypatch):
    """The reviewer's run: the second of two releases raised after the first request's blocks
    had gone back, and the step went out without ``captures_released``. And blocks given back
    are no frees vLLM should wait for (it would not preempt meanwhile)."""
    from semshare_vllm.vllm_compat import prefix_cache_reset

    core = EngineCore(engine_config(prefix_caching=True))
    bs = core.block_size
    first = core.add(core.request(ids(3 * bs + 5, 13)))
    second = core.add(core.request(ids(3 * bs + 5, 14)))
    core.run_to_end(first)
    core.run_to_end(second)
    release = prefix_cache_reset.release_blocks
    calls = []

    def flaky(manager, request):
        calls.append(request.request_id)
        if len(calls) == 2:
            raise RuntimeError("injected")
        release(manager, request)

    monkeypatch.setattr(prefix_cache_reset, "release_blocks", flaky)
    core.scheduler.reset_prefix_cache()  # vLLM's part fails: one request's blocks still held
    out = core.step()
    assert out.kv_connector_metadata.captures_released
    monkeypatch.setattr(prefix_cache_reset, "release_blocks", release)
    assert core.scheduler.reset_prefix_cache()
    assert not core.connector.has_pending_block_frees()  # all given back, the report to come
    core.step(KVConnectorOutput(finished_sending={first.request_id, second.request_id}))
    core.assert_empty()
    core.connector.shutdown()


def test_a_request_running_across_a_reset_is_no_donor():
    """``reset_prefix_cache(reset_connector=True)`` while a request runs (vLLM's own part
    fails: its blocks are in use; the connector's is done). The request's prompt KV was
    computed before the reset, with the weights of before. On main it finished after the
    reset's step and became a donor (a capture, offered to the next prompt)."""
    core = EngineCore(engine_config(prefix_caching=True))
    bs = core.block_size
    running = core.add(core.request(ids(6 * bs + 5, 15), max_tokens=6))
    core.step()
    assert not core.scheduler.reset_prefix_cache(reset_connector=True)  # vLLM: blocks in use
    assert core.step().kv_connector_metadata.reset
    core.run_to_end(running)
    assert core.finished[running.request_id][0] is False  # no capture: blocks freed at once
    assert len(core.ours.index) == 0
    core.assert_empty()
    core.connector.shutdown()


def test_a_weight_update_the_worker_saw_resets_the_connector():
    """The worker saw the model's weights updated in place (``weight_updates``) with no
    connector reset from vLLM, and says so in its report: the scheduler forgets every donor as
    a reset does, sends the reset back, and neither the request live then nor one finished
    before the reset's step becomes a donor. The donors after it serve."""
    from semshare_vllm.metadata import SemShareWorkerMetadata

    core = EngineCore(engine_config(prefix_caching=True))
    bs = core.block_size
    donor = core.add(core.request(ids(6 * bs + 5, 16)))
    core.capture(donor)
    live = core.add(core.request(ids(5 * bs + 3, 17), max_tokens=6))
    core.step()
    core.step(
        KVConnectorOutput(kv_connector_worker_meta=SemShareWorkerMetadata(weights_changed=True))
    )
    assert core.ours.stats.totals["connector_resets"] == 1
    assert len(core.ours.index) == 0 and core.ours.geometry.local_only
    out = core.step()
    assert out.kv_connector_metadata.reset and out.has_sync_kv_loads
    core.run_to_end(live)
    assert core.finished[live.request_id][0] is False

    core.scheduler.reset_prefix_cache()
    target = core.add(core.request(list(donor.prompt_token_ids) + ids(10, 18)))
    out = core.step()
    assert not out.kv_connector_metadata.loads  # nothing of before offered
    assert out.num_scheduled_tokens[target.request_id] == target.num_prompt_tokens
    key = core.capture(target).key  # after the reset: a donor again
    core.scheduler.reset_prefix_cache()
    again = core.add(core.request(list(target.prompt_token_ids[: 6 * bs]) + ids(9, 19)))
    (load,) = core.step().kv_connector_metadata.loads
    assert load.key == key
    core.run_to_end(again)
    core.connector.shutdown()


def test_with_two_steps_in_flight_a_request_finished_with_the_update_report_is_no_donor():
    """CUDA's default, async scheduling: the request finishes in the very output that carries
    the worker's report of a weight update (vLLM calls ``request_finished`` before it hands the
    connector that output). Its capture goes out with the reset, which the worker drops, and
    the donor is forgotten with the others: nothing of it is ever offered."""
    from semshare_vllm.metadata import SemShareWorkerMetadata

    core = EngineCore(engine_config(prefix_caching=True, async_scheduling=True))
    bs = core.block_size
    req = core.add(core.request(ids(6 * bs + 5, 20), max_tokens=1))
    assert core.pipeline() is not None  # its prefill, in flight
    report = KVConnectorOutput(
        kv_connector_worker_meta=SemShareWorkerMetadata(weights_changed=True)
    )
    core.pipeline(report)  # schedules another step, answers the prefill with the report
    assert req.is_finished() and core.finished[req.request_id][0] is True  # held: a capture
    assert len(core.ours.index) == 0 and core.ours.geometry.local_only
    out = core.pipeline()
    meta = out.kv_connector_metadata
    assert meta.reset and [c.req_id for c in meta.captures] == [req.request_id]
    core.drain(KVConnectorOutput(finished_sending={req.request_id}))  # the worker released it
    core.scheduler.reset_prefix_cache()
    again = core.add(core.request(list(req.prompt_token_ids) + ids(5, 21)))
    out = core.pipeline()
    assert not out.kv_connector_metadata.loads
    core.drain()
    for _ in range(20):
        if again.is_finished():
            break
        core.pipeline()
    core.drain()
    core.connector.shutdown()
