"""``vllm_compat.prefix_cache_reset`` on vLLM's own scheduler and cache manager: the step of ours
runs before vLLM checks its blocks, and a finished request's blocks given back early are not
freed a second time when vLLM frees them on the worker's report (vLLM pops the request's blocks
with a default)."""

from support.tokens import random_id_list as ids
from support.vllm_engine_core import EngineCore, engine_config

from semshare_vllm.vllm_compat import prefix_cache_reset


def test_the_step_runs_before_vllm_checks_its_blocks_and_a_second_free_is_a_no_op():
    core = EngineCore(engine_config(prefix_caching=True))
    manager = core.scheduler.kv_cache_manager
    req = core.add(core.request(ids(3 * core.block_size, 1), params={"semshare": "off"}))
    core.step()  # its blocks in use (as a request's held for a capture): vLLM's reset would fail
    used = core.num_blocks - 1 - core.free_blocks()
    assert used == 3

    seen = []

    def step():
        seen.append(core.free_blocks())
        prefix_cache_reset.release_blocks(manager, req)

    prefix_cache_reset.before_reset(manager, step)
    assert core.scheduler.reset_prefix_cache()  # our step gave the blocks back first
    assert seen == [core.num_blocks - 1 - used]
    free = core.free_blocks()
    prefix_cache_reset.release_blocks(manager, req)  # as vLLM does on the worker's report
    assert core.free_blocks() == free == core.num_blocks - 1
    core.connector.shutdown()
