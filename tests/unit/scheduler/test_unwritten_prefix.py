"""``hold_back_unwritten_prefix`` on hand-built step outputs (vLLM's real scheduler drives it in
tests/unit/vllm_scheduler/test_vllm_scheduler_same_step.py): which loads run, which are
reported failed, and what happens where the step's blocks cannot be read."""

from types import SimpleNamespace

from semshare_vllm.core.counters import StatsRecorder
from semshare_vllm.metadata import FailedLoad, LoadSpec
from semshare_vllm.scheduler.loads import (
    UNCONFIRMED_STEPS,
    LoadWatch,
    hold_back_every_repair,
    hold_back_unwritten_prefix,
)

BS = 16


def spec(req_id, dst_start, policy, block_ids):
    return LoadSpec(
        req_id=req_id,
        key=None,
        src_start=0,
        dst_start=dst_start,
        num_tokens=2 * BS,
        block_ids=block_ids,
        policy=policy,
    )


def step(new=(), cached=(), scheduled=None):
    """``new``: (req_id, block_ids, computed); ``cached``: (req_id, computed)."""
    return SimpleNamespace(
        scheduled_new_reqs=[
            SimpleNamespace(req_id=r, block_ids=(b,), num_computed_tokens=c) for r, b, c in new
        ],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, _ in cached], num_computed_tokens=[c for _, c in cached]
        ),
        num_scheduled_tokens=scheduled or {},
    )


class Manager:
    def __init__(self, blocks):
        self.blocks = blocks

    def get_block_ids(self, req_id):
        return (self.blocks[req_id],)


def test_only_repairs_over_blocks_the_step_fills_are_held_back():
    # A computes its blocks 10, 11 (full) and 12 (partial) in this step; C's 20 is older
    out = step(new=[("a", [10, 11, 12], 0)], scheduled={"a": 2 * BS + 3})
    over_a = spec("b", 2 * BS, "adaptive", [10, 11, 30, 31])
    over_old = spec("c", BS, "adaptive", [20, 32, 33])
    copy_only = spec("d", 2 * BS, "none", [10, 11, 34, 35])  # reads no prefix
    partial = spec("e", BS, "all", [12, 36, 37])  # a partial block is never a prefix hit
    loads, held = hold_back_unwritten_prefix(
        [over_a, over_old, copy_only, partial], [], out, Manager({}), BS
    )
    assert loads == [over_old, copy_only, partial]
    assert [(f.req_id, f.start, f.num_tokens, f.block_ids) for f in held] == [
        ("b", 2 * BS, 2 * BS, [10, 11, 30, 31])
    ]


def test_a_running_prefill_fills_blocks_it_was_given_earlier():
    out = step(cached=[("a", 2 * BS - 4)], scheduled={"a": BS + 4})  # fills blocks 1 and 2
    manager = Manager({"a": [10, 11, 12, 13]})
    held = hold_back_unwritten_prefix(
        [spec("b", 2 * BS, "adaptive", [10, 11, 40])], [], out, manager, BS
    )
    assert [f.req_id for f in held[1]] == ["b"]
    held = hold_back_unwritten_prefix([spec("b", BS, "adaptive", [10, 41])], [], out, manager, BS)
    assert held[1] == []  # block 10 was full before this step


def test_without_vllms_cache_manager_every_repair_behind_a_prefix_is_held_back():
    out = step(cached=[("a", 0)], scheduled={"a": BS})
    repaired = spec("b", BS, "adaptive", [50, 51])
    at_start = spec("c", 0, "adaptive", [52, 53])  # no prefix to read
    loads, held = hold_back_unwritten_prefix([repaired, at_start], [], out, None, BS)
    assert loads == [at_start] and [f.req_id for f in held] == ["b"]


def test_a_repair_behind_blocks_another_load_of_the_step_writes_or_fails_to_is_held_back():
    """A's load writes its blocks in the worker before B's repair runs, unless it fails there
    (donor gone, a tensor-parallel peer): B must not read them in the same step either way."""
    out = step(new=[("a", [10, 11, 12, 13], 4 * BS), ("b", [10, 11, 20, 21], 4 * BS)])
    a_load = spec("a", 0, "none", [10, 11, 12, 13])  # copies tokens 0-31 into blocks 10, 11
    b_load = spec("b", 2 * BS, "all", [10, 11, 20, 21])
    loads, held = hold_back_unwritten_prefix([a_load, b_load], [], out, Manager({}), BS)
    assert loads == [a_load] and [f.req_id for f in held] == ["b"]
    unplanned = FailedLoad("a", 0, 2 * BS, [10, 11, 12, 13])  # A's claim, reported failed
    loads, held = hold_back_unwritten_prefix([b_load], [unplanned], out, Manager({}), BS)
    assert loads == [] and [f.req_id for f in held] == ["b"]


def test_where_the_steps_blocks_cannot_be_told_every_repair_is_held_back():
    copy_only = spec("a", BS, "none", [1, 2])
    at_start = spec("b", 0, "adaptive", [3, 4])
    loads, held = hold_back_every_repair([copy_only, at_start])
    assert loads == [copy_only]
    assert [(f.req_id, f.start, f.block_ids) for f in held] == [("b", 0, [3, 4])]


def test_a_load_never_confirmed_stops_holding_requests_back_and_leaves_the_cache():
    """The worker says which loads ran (``loads_done``); until then a request whose vLLM hit
    holds their blocks waits. Should that word never come, the blocks leave vLLM's prefix cache
    after a few steps, as a failed load's do, and nobody waits for them any more."""
    evicted = []
    watch = LoadWatch(BS, StatsRecorder())
    watch.kv_cache_manager = SimpleNamespace(evict_blocks=evicted.append)
    loaded = SimpleNamespace(block_hashes=[b"p0", b"p1", b"h2", b"h3"], num_prompt_tokens=4 * BS)
    watch.unconfirmed(5, loaded, [40, 41, 42, 43], 2 * BS)  # writes its blocks 2 and 3
    same = SimpleNamespace(block_hashes=[b"p0", b"p1", b"h2", b"x"])
    assert not watch.behind_unconfirmed(same, 2 * BS)  # its hit: blocks vLLM computed
    assert watch.behind_unconfirmed(same, 3 * BS)
    watch.confirmed([5])
    assert not watch.behind_unconfirmed(same, 3 * BS)

    watch.unconfirmed(6, loaded, [40, 41, 42, 43], 2 * BS)
    for _ in range(UNCONFIRMED_STEPS - 1):
        watch.age_unconfirmed()
        assert watch.behind_unconfirmed(same, 3 * BS) and not evicted
    watch.age_unconfirmed()
    assert not watch.behind_unconfirmed(same, 3 * BS)
    assert evicted == [{42, 43}] and watch.stats.totals["unconfirmed_loads_uncached"] == 1
