"""A request served by the connector, preempted by vLLM's real scheduler when the KV cache runs
out, and resumed: vLLM asks the connector again (its computed tokens are back at 0), and the
load goes to the blocks it allocated on resumption (with prefix caching, vLLM's own cache holds
the loaded blocks again, and nothing is claimed)."""

import pytest
from support.tokens import random_id_list as ids
from support.vllm_engine_core import EngineCore, engine_config


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix-caching", "off"])
def test_a_preempted_request_is_claimed_again_into_its_new_blocks(prefix_caching):
    # 11 blocks (and vLLM's null block): a 4-block request decoding next to a 7-block one
    core = EngineCore(engine_config(prefix_caching=prefix_caching), num_blocks=12)
    core.acks_captures = True  # the worker reports each capture done in its step
    bs = core.block_size
    donor = core.add(core.request(ids(6 * bs + 5, 31), max_tokens=1))
    core.run_to_end(donor)
    core.step()  # its capture, reported done
    core.scheduler.reset_prefix_cache()

    running = core.add(core.request(ids(4 * bs - 1, 32), max_tokens=8))
    core.step()  # its prompt fills 4 blocks; its second decode token needs a fifth
    prompt = list(donor.prompt_token_ids[: 6 * bs]) + ids(bs - 2, 33)
    target = core.add(core.request(prompt, max_tokens=4))
    out = core.step()
    (load,) = out.kv_connector_metadata.loads
    assert (load.req_id, load.dst_start, load.num_tokens) == (target.request_id, 0, 6 * bs)
    first_blocks = load.block_ids
    assert first_blocks == core.block_ids(target.request_id) and len(first_blocks) == 7

    for _ in range(20):  # until vLLM takes the newest request's blocks
        out = core.step()
        if target.num_preemptions:
            break
    assert target.num_preemptions == 1 and target.num_computed_tokens == 0

    resumed = None
    for _ in range(40):
        out = core.step()
        if target.request_id in out.num_scheduled_tokens:
            resumed = out
            break
    assert resumed is not None and running.is_finished()
    assert target.request_id in resumed.scheduled_cached_reqs.resumed_req_ids
    # the donor's 6 blocks are not computed again
    assert resumed.num_scheduled_tokens[target.request_id] == target.num_computed_tokens - 6 * bs
    loads = resumed.kv_connector_metadata.loads
    if prefix_caching:  # vLLM's own cache holds them (the first load's blocks, exact KV)
        assert not loads
    else:  # claimed again, into the blocks allocated on resumption
        (load,) = loads
        assert (load.dst_start, load.num_tokens) == (0, 6 * bs)
        assert load.block_ids == core.block_ids(target.request_id)
    core.run_to_end(target)
    core.step()
    core.connector.shutdown()
    core.assert_empty()


def test_a_scored_request_resumed_after_its_prompt_is_not_claimed_again():
    """A request asking for prompt logprobs with ``semshare_reuse_limit`` is served, decodes,
    and is preempted. Its prompt logprobs went out with its first token, and vLLM's runner
    keeps no rows for it any more: claimed again on resumption, the worker could not mark its
    rows, failed the load, and the restart asked the runner for the rows again, so the client
    got every prompt logprob twice (455 rows for a 228-token prompt, the reviewer's run with
    SmolLM2). Without the connector vLLM resumes it from its own computation, scoring nothing
    again: so do we."""
    core = EngineCore(engine_config(prefix_caching=True))
    bs = core.block_size
    donor = core.add(core.request(ids(8 * bs + 5, 41)))
    core.step()
    core.capture(donor)
    core.scheduler.reset_prefix_cache()
    core.acks_captures = True

    prompt = list(donor.prompt_token_ids[: 8 * bs]) + ids(20, 42)
    target = core.add(
        core.request(
            prompt, max_tokens=8, prompt_logprobs=1, params={"semshare_reuse_limit": 8 * bs}
        )
    )
    (load,) = core.step().kv_connector_metadata.loads
    assert load.req_id == target.request_id and load.mark_logprobs_until == 8 * bs
    for _ in range(10):
        if target.num_output_tokens >= 3:
            break
        core.step()
    assert target.num_output_tokens >= 3
    assert core.scheduler.reset_prefix_cache(reset_running_requests=True)
    assert target.num_preemptions == 1 and target.num_computed_tokens == 0

    resumed = core.step()
    assert target.request_id in resumed.scheduled_cached_reqs.resumed_req_ids
    meta = resumed.kv_connector_metadata
    assert not meta.loads and meta.restart_logprob_rows == []
    assert resumed.num_scheduled_tokens[target.request_id] == target.num_computed_tokens
    core.run_to_end(target)
    core.step()
    core.connector.shutdown()
    core.assert_empty()
