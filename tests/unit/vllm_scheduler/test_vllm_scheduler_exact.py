"""Exact-prefix reuse through vLLM's real scheduler: what vLLM allocates for the connector's
claim, the metadata the worker receives, and the donors' captures (blocks held, then freed)."""

import pytest
from support.tokens import random_id_list as ids
from support.vllm_engine_core import EngineCore, engine_config
from vllm.v1.outputs import KVConnectorOutput


@pytest.fixture(params=[True, False], ids=["prefix-caching", "no-prefix-caching"])
def core(request):
    core = EngineCore(engine_config(prefix_caching=request.param))
    yield core
    core.connector.shutdown()


def test_a_prefix_only_the_connector_holds_is_loaded_into_the_blocks_vllm_allocated(core):
    bs = core.block_size
    donor = core.add(core.request(ids(10 * bs + 5, 1)))
    out = core.step()
    assert out.num_scheduled_tokens[donor.request_id] == donor.num_prompt_tokens
    key = core.capture(donor).key
    core.scheduler.reset_prefix_cache()  # vLLM's own copy evicted: only ours is left
    assert core.free_blocks() == core.num_blocks - 1

    prompt = list(donor.prompt_token_ids[: 7 * bs + 3]) + ids(40, 2)
    assert core.cached_hits(prompt) == 0
    target = core.add(core.request(prompt))
    out = core.step()
    (new,) = out.scheduled_new_reqs
    assert new.req_id == target.request_id and new.num_computed_tokens == 7 * bs
    assert out.num_scheduled_tokens[target.request_id] == len(prompt) - 7 * bs
    (load,) = out.kv_connector_metadata.loads
    # our loads are synchronous: vLLM's runners then start them before the step's forward
    # (0.33's V1 mixin and V2 runner start loads after it unless this flag is set)
    assert out.has_sync_kv_loads
    assert (load.key, load.src_start, load.dst_start, load.num_tokens) == (key, 0, 0, 7 * bs)
    assert load.block_ids == list(new.block_ids[0]) == core.block_ids(target.request_id)
    assert load.policy == "none" and not out.kv_connector_metadata.failed_loads
    assert core.ours.stats.totals["hit_tokens"] == 7 * bs

    spec = core.capture(target)  # a new donor: its blocks, the claim's among them
    assert spec.block_ids[:7] == load.block_ids[:7]
    core.assert_empty()


def test_a_claim_continues_vllms_own_prefix_cache_hit():
    """vLLM's prefix cache holds the donor's first blocks (computed for another request): the
    connector is asked from there, claims the rest of its donor, and the load writes only the
    blocks after vLLM's hit."""
    core = EngineCore(engine_config(prefix_caching=True))
    bs = core.block_size
    donor = core.add(core.request(ids(12 * bs + 5, 3)))
    core.step()
    key = core.capture(donor).key
    core.scheduler.reset_prefix_cache()
    head = list(donor.prompt_token_ids[: 4 * bs]) + ids(10, 4)
    other = core.add(core.request(head, params={"semshare": "off"}))  # vLLM computes it all
    out = core.step()
    assert out.num_scheduled_tokens[other.request_id] == len(head)
    assert not out.kv_connector_metadata.loads
    core.run_to_end(other)  # opted out: not captured, its blocks freed (and cached) at once
    assert core.cached_hits(donor.prompt_token_ids) == 4 * bs

    prompt = list(donor.prompt_token_ids) + ids(30, 5)
    target = core.add(core.request(prompt))
    out = core.step()
    (new,) = out.scheduled_new_reqs
    end = 12 * bs  # the donor's whole blocks
    assert new.num_computed_tokens == end
    assert out.num_scheduled_tokens[target.request_id] == len(prompt) - end
    (load,) = out.kv_connector_metadata.loads
    assert load.key == key
    assert (load.src_start, load.dst_start, load.num_tokens) == (4 * bs, 4 * bs, end - 4 * bs)
    assert load.block_ids == list(new.block_ids[0])
    core.capture(target)
    core.connector.shutdown()
    core.assert_empty()


def test_with_two_steps_in_flight_a_donor_held_for_its_capture_serves_a_new_request():
    """CUDA's default: async scheduling, the engine core scheduling a step before the last one's
    output is processed, vLLM deferring frees. The donor's blocks stay held until the worker
    reports the capture; a request arriving meanwhile is served from the donor into other
    blocks (the worker captures before it loads, in the same step)."""
    core = EngineCore(engine_config(prefix_caching=False, async_scheduling=True))
    assert type(core.scheduler).__name__ == "AsyncScheduler" and core.scheduler.defer_block_free
    bs = core.block_size
    donor = core.add(core.request(ids(10 * bs + 5, 21), max_tokens=4))
    captures = []
    for _ in range(30):
        out = core.pipeline()
        if out is not None:
            captures += out.kv_connector_metadata.captures
        if captures:
            break
    (spec,) = captures
    assert donor.is_finished() and spec.req_id == donor.request_id
    held = core.block_ids(donor.request_id)
    assert spec.block_ids == held[: len(spec.block_ids)]

    prompt = list(donor.prompt_token_ids[: 9 * bs]) + ids(7, 22)
    target = core.add(core.request(prompt))
    out = core.pipeline()
    assert out is not None and target.request_id in out.num_scheduled_tokens
    (load,) = out.kv_connector_metadata.loads
    assert (load.key, load.dst_start, load.num_tokens) == (spec.key, 0, 9 * bs)
    assert not set(load.block_ids) & set(held)  # the held blocks are not handed out
    assert core.block_ids(donor.request_id) == held  # still held: no capture reported yet

    core.drain(KVConnectorOutput(finished_sending={donor.request_id}))
    for _ in range(30):
        if target.is_finished():
            break
        core.pipeline()
    assert target.is_finished()
    core.drain()
    captures = [c for c in core.step().kv_connector_metadata.captures]
    assert [c.req_id for c in captures] == [target.request_id]  # a donor in its turn
    core.step(KVConnectorOutput(finished_sending={target.request_id}))
    core.connector.shutdown()
    core.assert_empty()


def test_with_chunked_prefill_the_claim_is_loaded_before_the_first_chunk():
    """A step budget of 4 blocks: the claim counts as computed at admission, the rest of the
    prompt is computed in chunks after it, and only the first step carries the load."""
    core = EngineCore(engine_config(prefix_caching=False, max_batched_tokens=64))
    core.acks_captures = True
    bs = core.block_size
    donor = core.add(core.request(ids(3 * bs + 5, 41), max_tokens=1))
    core.run_to_end(donor)
    core.step()
    prompt = list(donor.prompt_token_ids[: 3 * bs]) + ids(150, 42)
    target = core.add(core.request(prompt))
    steps = [core.step() for _ in range(4)]
    loads = [load for out in steps for load in out.kv_connector_metadata.loads]
    assert [(load.dst_start, load.num_tokens) for load in loads] == [(0, 3 * bs)]
    assert steps[0].scheduled_new_reqs[0].num_computed_tokens == 3 * bs
    chunks = [out.num_scheduled_tokens.get(target.request_id, 0) for out in steps]
    assert sum(chunks[:3]) >= len(prompt) - 3 * bs and max(chunks) <= 64
    assert loads[0].block_ids == core.block_ids(target.request_id)[: len(loads[0].block_ids)]
    core.run_to_end(target)
    core.step()
    core.connector.shutdown()
    core.assert_empty()
