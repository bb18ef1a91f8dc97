"""A load the worker reports failed, through vLLM's real scheduler with its default
``kv_load_failure_policy``: vLLM recomputes the failed tokens (the connector asks for
"recompute"), the donor is forgotten, the failed blocks leave vLLM's prefix cache, and the
request is never captured."""

import time

import pytest
from support.tokens import random_id_list as ids
from support.vllm_engine_core import SAMPLED, EngineCore, engine_config
from vllm.v1.outputs import KVConnectorOutput

from semshare_vllm.worker.reports import WorkerReport


def donor_only_we_hold(core, blocks: int, seed: int):
    """A donor of ``blocks`` full blocks and 5 tokens, run to its end and captured, then vLLM's
    prefix cache reset: only the connector holds its KV. (The donor request, its key.)"""
    donor = core.add(core.request(ids(blocks * core.block_size + 5, seed)))
    key = core.capture(donor).key
    core.scheduler.reset_prefix_cache()
    return donor, key


def worker_failure(core, load) -> KVConnectorOutput:
    """What our worker sends when a load's donor cannot be read (``worker/loads.py``): every
    block of the loaded range failed, the donor bad."""
    report = WorkerReport(core.block_size)
    report.fail_load(load.req_id, load.block_ids, load.dst_start, load.num_tokens)
    report.bad_donors.append(load.key)
    return KVConnectorOutput(
        invalid_block_ids=report.take_invalid_blocks(),
        kv_connector_worker_meta=report.take_worker_meta(),
    )


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix-caching", "off"])
def test_a_failed_load_is_recomputed_and_its_donor_forgotten(prefix_caching):
    config = engine_config(prefix_caching=prefix_caching)
    assert config.kv_transfer_config.kv_load_failure_policy == "fail"  # vLLM's default
    core = EngineCore(config)
    assert core.scheduler.recompute_kv_load_failures  # the connector set "recompute"
    bs = core.block_size
    donor, key = donor_only_we_hold(core, 10, 11)

    prompt = list(donor.prompt_token_ids[: 8 * bs]) + ids(20, 12)
    target = core.add(core.request(prompt))
    out = core.schedule()  # answered below, with the worker's failure
    (load,) = out.kv_connector_metadata.loads
    assert (load.dst_start, load.num_tokens) == (0, 8 * bs)
    if prefix_caching:  # vLLM cached the step's full blocks under their hashes at allocation
        assert core.cached_hits(prompt) == len(prompt) // bs * bs
    core.answer(out, worker_failure(core, load))

    # vLLM rewinds to the first failed block and drops the step's token (nothing in flight:
    # no preemption)
    assert target.num_computed_tokens == 0 and target.num_output_tokens == 0
    assert target.num_preemptions == 0 and "failed_loads_preempted" not in core.ours.stats.totals
    assert core.cached_hits(prompt) == 0  # never served to anyone from unwritten blocks
    assert key not in core.ours.index
    out = core.step()
    assert out.num_scheduled_tokens[target.request_id] == len(prompt)  # all recomputed
    assert out.kv_connector_metadata.evictions == [key]  # the worker drops its copy too
    assert not out.kv_connector_metadata.loads
    core.run_to_end(target)
    # its blocks may hold what was never written: not captured, freed at once
    delay, params = core.finished[target.request_id]
    assert delay is False and params["semshare_provenance"]["load_failed"] is True
    assert target.request_id not in core.scheduler.requests
    # the failed blocks and every one computed after them from that KV
    assert core.ours.stats.totals["failed_blocks_uncached"] == len(load.block_ids)
    core.connector.shutdown()
    core.assert_empty()


def test_a_failed_load_behind_vllms_own_hit_recomputes_the_claim_only():
    core = EngineCore(engine_config(prefix_caching=True))
    bs = core.block_size
    donor, _ = donor_only_we_hold(core, 12, 13)
    head = list(donor.prompt_token_ids[: 4 * bs]) + ids(10, 14)
    core.run_to_end(core.add(core.request(head, params={"semshare": "off"})))

    prompt = list(donor.prompt_token_ids) + ids(30, 15)
    target = core.add(core.request(prompt))
    out = core.schedule()  # answered below, with the worker's failure
    (load,) = out.kv_connector_metadata.loads
    assert load.dst_start == 4 * bs
    core.answer(out, worker_failure(core, load))
    assert target.num_computed_tokens == 4 * bs  # vLLM's own hit stays
    assert core.cached_hits(prompt) == 4 * bs
    out = core.step()
    assert out.num_scheduled_tokens[target.request_id] == len(prompt) - 4 * bs
    core.run_to_end(target)
    core.connector.shutdown()
    core.assert_empty()


def test_with_two_steps_in_flight_a_failed_load_is_recomputed():
    """Async scheduling (CUDA's default), as the engine core runs it (two steps in flight): the
    failure comes back with the load's step while the request's next step is already
    scheduled, decoding over the blocks the load never wrote from the token sampled over them.
    vLLM rewinds the request but would deliver that step's token (and its runner would take it
    as the recomputed prompt's last input): the request is preempted instead, that step's
    output dropped, and every token the client gets comes from the prompt computed again."""
    core = EngineCore(engine_config(prefix_caching=True, async_scheduling=True))
    core.numbered = True  # each step samples its own token
    bs = core.block_size
    donor, key = donor_only_we_hold(core, 10, 16)

    prompt = list(donor.prompt_token_ids[: 8 * bs]) + ids(20, 17)
    target = core.add(core.request(prompt, max_tokens=4))
    (load,) = core.pipeline().kv_connector_metadata.loads
    ahead = core.pipeline(worker_failure(core, load))  # the next step, then the failed one's
    assert dict(ahead.num_scheduled_tokens) == {target.request_id: 1}
    assert core.cached_hits(prompt) == 0 and key not in core.ours.index
    _assert_recomputed_from_its_prompt(core, target, prompt, ahead)


def test_with_two_steps_in_flight_a_load_held_back_is_recomputed():
    """The same, for a load the scheduler half fails itself, with no fault anywhere: a repaired
    load behind a prefix another request computes in the same step (``hold_back``)."""
    core = EngineCore(
        engine_config(
            prefix_caching=True,
            block_size=16,
            extra={"recompute_policy": "all"},
            async_scheduling=True,
        )
    )
    core.numbered = True
    bs = core.block_size
    donor, _ = donor_only_we_hold(core, 20, 18)
    tokens = list(donor.prompt_token_ids)
    core.add(core.request(tokens[: 6 * bs] + ids(40, 19), params={"semshare": "off"}))
    prompt = tokens[: 18 * bs] + ids(30, 20)
    target = core.add(core.request(prompt, max_tokens=4))
    (failed,) = core.pipeline().kv_connector_metadata.failed_loads  # held back
    assert failed.req_id == target.request_id
    report = WorkerReport(bs)
    report.fail_load(failed.req_id, failed.block_ids, failed.start, failed.num_tokens)
    ahead = core.pipeline(
        KVConnectorOutput(
            invalid_block_ids=report.take_invalid_blocks(),
            kv_connector_worker_meta=report.take_worker_meta(),
        )
    )
    assert ahead.num_scheduled_tokens.get(target.request_id) == 1  # over the unwritten claim
    _assert_recomputed_from_its_prompt(core, target, prompt, ahead)


def test_with_two_steps_in_flight_a_resumed_request_gives_the_v1_runner_its_tokens():
    """A request with output tokens (preempted for memory, admitted again and claimed for
    again) whose load fails while its next step runs: preempted again, it is resumed by the
    very next schedule. vLLM's V1 runner (CUDA with ``VLLM_USE_V2_MODEL_RUNNER=0``, or a
    feature V2 lacks) drops a resumed request from its batch and, under async scheduling, reads
    its tokens from ``all_token_ids``, which vLLM fills only for requests not scheduled in the
    step before: it raised KeyError and the engine died (the reviewer's trace)."""
    core = EngineCore(engine_config(prefix_caching=True, async_scheduling=True))
    core.scheduler.use_v2_model_runner = False  # the scheduler output the V1 runner gets
    bs = core.block_size
    donor, _ = donor_only_we_hold(core, 10, 26)
    prompt = list(donor.prompt_token_ids[: 8 * bs]) + ids(20, 27)
    target = core.add(core.request(prompt, max_tokens=8))
    rid = target.request_id
    while target.num_output_tokens < 2:
        core.pipeline()
    core.drain()
    s = core.scheduler
    s.running.remove(target)  # as vLLM preempts under memory pressure
    s._preempt_request(target, 0.0)
    s.reset_prefix_cache()  # its blocks leave vLLM's cache: its resume is ours to claim
    out = core.pipeline()
    (load,) = [spec for spec in out.kv_connector_metadata.loads if spec.req_id == rid]
    ahead = core.pipeline(worker_failure(core, load))
    assert rid in ahead.num_scheduled_tokens and target.num_preemptions == 2
    for _ in range(5):
        out = core.pipeline()
        if out is not None and rid in out.scheduled_cached_reqs.resumed_req_ids:
            break
    data = out.scheduled_cached_reqs
    assert data.num_output_tokens[data.req_ids.index(rid)] > 0
    assert rid in data.all_token_ids  # what the V1 runner reads for it
    for _ in range(30):
        if target.is_finished() and not core.in_flight:
            break
        core.pipeline()
    assert target.is_finished() and target.num_output_tokens == 8
    core.step()
    core.connector.shutdown()
    core.assert_empty()


def test_with_two_steps_in_flight_the_next_chunk_over_a_failed_load_leaves_vllms_cache():
    """Chunked prefill: step t loads 8 blocks and computes a first chunk; step t+1, scheduled
    before t's output, computes the next chunk over the load's blocks, and vLLM cached those
    blocks under their true hashes when it allocated them. The load fails: the request is
    recomputed, but those stale blocks stayed cached (vLLM keeps the first block of a hash),
    and a later request with the same prompt took them as its exact hit (the reviewer's
    trace: blocks [22, 23, 24])."""
    bs = 16
    core = EngineCore(
        engine_config(
            prefix_caching=True, block_size=bs, max_batched_tokens=3 * bs, async_scheduling=True
        )
    )
    donor, _ = donor_only_we_hold(core, 10, 40)
    prompt = list(donor.prompt_token_ids[: 8 * bs]) + ids(6 * bs + 5, 41)
    target = core.add(core.request(prompt, max_tokens=2))
    rid = target.request_id
    out = core.pipeline()  # step t: the load (8 blocks) and a 3-block chunk
    (load,) = out.kv_connector_metadata.loads
    assert out.num_scheduled_tokens[rid] == 3 * bs
    held_at_load = core.block_ids(rid)
    ahead = core.pipeline(worker_failure(core, load))  # step t+1, then step t's failure
    assert ahead.num_scheduled_tokens.get(rid) == 3 * bs  # the next chunk, over the failure
    assert target.num_preemptions == 1
    # the blocks step t+1 fills: allocated in it, cached at once, computed over the failure
    data = ahead.scheduled_cached_reqs
    (chunk,) = data.new_block_ids[data.req_ids.index(rid)]
    assert len(chunk) == 3 and not set(chunk) & set(held_at_load)
    pool = core.scheduler.kv_cache_manager.block_pool.blocks
    assert [b for b in chunk if pool[b].block_hash is not None] == []  # out of vLLM's cache
    final = []  # the blocks it holds as it is computed again
    for _ in range(40):
        if target.is_finished() and not core.in_flight:
            break
        core.pipeline()
        final = core.block_ids(rid) if rid in core.scheduler.requests else final
    core.drain()
    assert target.is_finished()
    # a later request with the same prompt: served what the recompute wrote, whole
    probe = core.request(prompt, req_id="probe")
    blocks, hit, _ = core.scheduler.kv_cache_manager.get_computed_blocks(probe)
    assert hit == 14 * bs and [b.block_id for b in blocks.blocks[0]] == final[:14]
    core.step()
    core.connector.shutdown()


def test_requests_preempted_after_failed_loads_keep_their_order_in_the_queue():
    """Two requests whose loads fail in one output, each with its next step in flight: both
    go back to the front of the waiting queue in the order they ran (as vLLM's reset leaves
    them), not reversed."""
    core = EngineCore(engine_config(prefix_caching=True, async_scheduling=True))
    bs = core.block_size
    donors = [donor_only_we_hold(core, 10, seed)[0] for seed in (28, 29)]
    first, second = (
        core.add(core.request(list(d.prompt_token_ids[: 8 * bs]) + ids(20, 30 + i)))
        for i, d in enumerate(donors)
    )
    loads = core.pipeline().kv_connector_metadata.loads
    assert {spec.req_id for spec in loads} == {first.request_id, second.request_id}
    report = WorkerReport(bs)
    for spec in loads:
        report.fail_load(spec.req_id, spec.block_ids, spec.dst_start, spec.num_tokens)
    core.pipeline(
        KVConnectorOutput(
            invalid_block_ids=report.take_invalid_blocks(),
            kv_connector_worker_meta=report.take_worker_meta(),
        )
    )
    assert first.num_preemptions == second.num_preemptions == 1
    waiting = [r.request_id for r in core.scheduler.waiting]
    assert waiting[:2] == [first.request_id, second.request_id]
    for _ in range(30):
        if first.is_finished() and second.is_finished() and not core.in_flight:
            break
        core.pipeline()
    core.step()
    core.connector.shutdown()
    core.assert_empty()


def _assert_recomputed_from_its_prompt(core, target, prompt, ahead) -> None:
    """``target``'s failed load came back while ``ahead`` (its next step) ran: it was preempted
    (the runner told to forget it), ``ahead``'s output dropped, its prompt computed again with
    no claim of ours, and each token the client got sampled from that recompute on."""
    from vllm.v1.request import RequestStatus

    rid = target.request_id
    preempted = target.status == RequestStatus.PREEMPTED and target.num_output_tokens == 0
    sent = lambda: [t for o in core.outputs if o.request_id == rid for t in o.new_token_ids]  # noqa: E731
    steps, loads, captures = [], [], []
    for _ in range(30):
        if target.is_finished() and not core.in_flight:
            break
        out = core.pipeline()
        if out is not None:
            steps.append(out)
            loads += [spec for spec in out.kv_connector_metadata.loads if spec.req_id == rid]
            captures += out.kv_connector_metadata.captures
    assert core.step_token[id(ahead)] not in sent()  # the step over the failed load: dropped
    assert preempted and rid in steps[0].preempted_req_ids  # the runner forgets what it held
    # admitted again: the rest of its prompt (past what vLLM's prefix cache still holds)
    recompute = next(s for s in steps if rid in s.num_scheduled_tokens)
    assert recompute.num_scheduled_tokens[rid] > 1
    first = core.step_token[id(recompute)]
    tokens = sent()
    assert len(tokens) == 4 and tokens[0] == first and all(t >= first for t in tokens)
    assert list(target.output_token_ids) == tokens
    assert not loads  # vLLM computes it: no claim of ours again
    assert not captures and core.finished[rid][0] is False  # no donor
    assert target.num_preemptions == 1
    assert core.ours.stats.totals["failed_loads_preempted"] == 1
    core.step()
    core.connector.shutdown()
    core.assert_empty()


def test_a_scored_requests_failed_load_restarts_its_prompt_logprob_rows():
    """A request asking for prompt logprobs with ``semshare_reuse_limit`` (vLLM reads no cache
    for it; we serve it and mark its rows): its load fails, vLLM rewinds it to position 0, and
    the step that recomputes it tells the worker, once, to forget the rows it holds."""
    core = EngineCore(engine_config(prefix_caching=True))
    bs = core.block_size
    donor = core.add(core.request(ids(10 * bs + 5, 21)))
    core.step()
    core.capture(donor)

    prompt = list(donor.prompt_token_ids[: 8 * bs]) + ids(20, 22)
    target = core.add(
        core.request(prompt, prompt_logprobs=1, params={"semshare_reuse_limit": 8 * bs})
    )
    assert target.skip_reading_prefix_cache  # what vLLM sets for prompt logprobs
    out = core.schedule()
    (load,) = out.kv_connector_metadata.loads
    assert (load.dst_start, load.num_tokens, load.mark_logprobs_until) == (0, 8 * bs, 8 * bs)
    assert out.kv_connector_metadata.restart_logprob_rows == []
    core.answer(out, worker_failure(core, load))
    assert target.num_computed_tokens == 0  # vLLM computes the prompt again from 0

    out = core.step()
    assert out.num_scheduled_tokens[target.request_id] == len(prompt)
    assert out.kv_connector_metadata.restart_logprob_rows == [target.request_id]
    # the restart before the forward: the V2 runner computes a chunk's prompt logprobs in it
    assert out.has_sync_kv_loads
    assert core.step().kv_connector_metadata.restart_logprob_rows == []  # once
    core.run_to_end(target)
    core.connector.shutdown()


def async_core_with_load(salt: int):
    """Async scheduling, prefix caching on: a donor only the connector holds, and request R
    claiming 8 of its blocks, its step in flight; then S with the same 8-block prefix."""
    core = EngineCore(engine_config(prefix_caching=True, async_scheduling=True))
    bs = core.block_size
    donor, _ = donor_only_we_hold(core, 10, salt)
    prefix = list(donor.prompt_token_ids[: 8 * bs])
    r = core.add(core.request(prefix + ids(20, salt + 1), max_tokens=4))
    (load,) = core.pipeline().kv_connector_metadata.loads  # step t: R's load, in flight
    s = core.add(core.request(prefix + ids(20, salt + 2), max_tokens=4))
    return core, r, s, load


def run_all(core, *reqs) -> dict[str, list[int]]:
    """Every step to the end: the tokens each request was scheduled per step."""
    scheduled = {r.request_id: [] for r in reqs}
    for _ in range(60):
        if all(r.is_finished() for r in reqs) and not core.in_flight:
            break
        out = core.pipeline()
        if out is not None:
            for r in reqs:
                scheduled[r.request_id].append(out.num_scheduled_tokens.get(r.request_id, 0))
    assert all(r.is_finished() for r in reqs)
    core.drain()
    # the captures of those kept as donors done: vLLM frees their blocks
    held = {r.request_id for r in reqs if core.finished[r.request_id][0]}
    core.step(KVConnectorOutput(finished_sending=held))
    return scheduled


def test_with_async_scheduling_no_request_takes_a_load_in_flight_as_its_prefix():
    """Async scheduling (CUDA's default): the step after R's is scheduled before R's output
    comes back. vLLM cached R's blocks when it allocated them, so S took them as its own
    prefix-cache hit in that step; R's load then failed in the worker, vLLM rewound R, but left
    S's tokens computed over the KV nobody wrote (it counts on R to recompute the shared blocks,
    which holds only when both are in one step): S's first token and its suffix's KV came from
    garbage (the reviewer's trace: S scheduled 20 tokens, then 1, 1, 1, never its prefix). Now
    S waits until R's load is known written: here it failed, R (preempted, its next step was in
    flight) computes its prompt again, and S takes the prefix no earlier than the step that
    writes it (vLLM writes each layer's new KV before any request of the step reads it)."""
    core, r, s, load = async_core_with_load(16)
    ahead = core.pipeline(worker_failure(core, load))  # step t+1, then step t's failure
    assert s.request_id not in ahead.num_scheduled_tokens  # not behind R's unwritten blocks
    assert core.ours.stats.totals["waits_behind_unconfirmed_loads"] >= 1
    scheduled = run_all(core, r, s)
    r_steps, s_steps = scheduled[r.request_id], scheduled[s.request_id]
    recompute = next(i for i, n in enumerate(r_steps) if n > 1)
    assert r_steps[recompute] == len(r.prompt_token_ids)  # from 0: the failed blocks left
    assert next(i for i, n in enumerate(s_steps) if n) >= recompute
    core.connector.shutdown()
    core.assert_empty()


def test_with_async_scheduling_a_request_behind_a_written_load_shares_its_blocks():
    """The control: R's load succeeds; S, a step later, takes R's written blocks as its hit."""
    core, r, s, load = async_core_with_load(26)
    ahead = core.pipeline()  # step t+1, then step t's output: R's load written
    assert s.request_id not in ahead.num_scheduled_tokens
    scheduled = run_all(core, r, s)
    first = next(n for n in scheduled[s.request_id] if n)
    assert first == 20  # its own suffix only: the 8 blocks came from R's load
    core.connector.shutdown()
    core.assert_empty()


def test_a_load_past_the_prompt_is_waited_for_too():
    """A request resumed after a preemption may be claimed beyond its prompt (its output
    tokens are in a donor too). Only blocks up to the prompt's end were kept back, so S, the
    same tokens and more, took the output blocks R's load had yet to write in the next async
    step, and kept its tokens when that load failed (the reviewer's reproduction: S's hit of
    160 tokens, past the 128 where R's load began)."""
    core = EngineCore(engine_config(prefix_caching=True, async_scheduling=True, block_size=16))
    bs = core.block_size
    k = 2 * bs + 5
    prompt = ids(8 * bs + 3, 71)
    donor = core.add(core.request(prompt + [SAMPLED] * k + ids(5, 72), max_tokens=1))
    core.step()
    core.capture(donor)
    core.scheduler.reset_prefix_cache()

    r = core.add(core.request(prompt, max_tokens=k + 50))
    for _ in range(200):
        if r.num_output_tokens >= k:
            break
        core.step()
    assert list(r.all_token_ids)[: len(prompt) + k] == prompt + [SAMPLED] * k
    blocks = core.block_ids(r.request_id)
    core.scheduler.running.remove(r)  # preempted, as vLLM's schedule() does out of blocks
    core.scheduler._preempt_request(r, time.monotonic())
    # its freed tail reused first: only its prompt's full blocks stay in vLLM's cache
    core.scheduler.kv_cache_manager.evict_blocks(set(blocks[len(prompt) // bs :]))

    (load,) = core.pipeline().kv_connector_metadata.loads  # R resumed: its output blocks
    assert load.req_id == r.request_id and load.dst_start >= r.num_prompt_tokens // bs * bs
    s = core.add(core.request(list(r.all_token_ids) + ids(20, 73), max_tokens=2))
    ahead = core.pipeline(worker_failure(core, load))  # step t+1, then step t's failure
    assert s.request_id not in ahead.num_scheduled_tokens
    assert s.num_computed_tokens <= load.dst_start  # nothing of R's failed load counted
