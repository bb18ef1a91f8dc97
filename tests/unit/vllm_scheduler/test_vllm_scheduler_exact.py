"""Exact-prefix reuse through vLLM's real scheduler: what vLLM allocates for the connector's
claim, the metadata the worker receives, and the donors' captures (blocks held, then freed)."""

import pytest
from support.tokens import random_id_list as ids
from support.vllm_engine_core import EngineCore, engine_config


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
