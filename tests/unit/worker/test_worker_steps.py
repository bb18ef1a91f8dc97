"""The worker half's steps over real CPU tensors (no engine): a capture copies a finished
request's blocks into the host store and frees them; an exact load copies them into another
request's blocks; a claim the scheduler could not plan (``FailedLoad``) and a load whose donor is
gone report their blocks failed, and a request whose load failed is never captured."""

import numpy as np
import pytest
import torch
from support.clock import SteppedClock
from support.worker import BS, LAYERS, caches, make_worker

from semshare_vllm.core.keys import DonorKey
from semshare_vllm.metadata import CaptureSpec, FailedLoad, LoadSpec, SemShareConnectorMetadata
from semshare_vllm.store.host_store import HostKVStore
from semshare_vllm.worker import setup


def registered_worker(monkeypatch, persist_root=None):
    def host_store(config, geometry, layout, cache, rank):
        return HostKVStore(
            1 << 20,
            list(LAYERS),
            tuple(cache.shape[1:]),
            cache.dtype,
            layout.name,
            persist_root=persist_root,
            page_layout=layout,
        )

    views = {n: v[0] for n, v in caches().items()}
    w = make_worker(monkeypatch, bound=views)
    monkeypatch.setattr(setup, "make_store", host_store)
    w.register_kv_caches(views)
    assert w.disabled is None
    for cache in w.kv.caches:
        cache.copy_(torch.randn(cache.shape, generator=torch.Generator().manual_seed(0)))
    return w


def captured_donor(w, num_prompt_tokens: int | None = None) -> DonorKey:
    """Request "a"'s 40 tokens (``num_prompt_tokens`` of them its prompt), in blocks 1 and 2,
    captured into the host pool and released there (loads then read the pool): the donor's
    key."""
    key = DonorKey("", "d")
    spec = CaptureSpec("a", key, list(range(40)), [1, 2], num_prompt_tokens)
    w.start_load_kv(SemShareConnectorMetadata(captures=[spec]))
    w.start_captures()
    w.flush_captures()
    w.get_finished({"a"})
    return key


def test_capture_then_exact_load_then_failed_loads(monkeypatch):
    w = registered_worker(monkeypatch)
    key = DonorKey("", "d")
    w.start_load_kv(
        SemShareConnectorMetadata(captures=[CaptureSpec("a", key, list(range(40)), [1, 2])])
    )
    w.start_captures()
    w.flush_captures()
    assert w.get_finished({"a"}) == ({"a"}, None)  # its blocks may be freed
    assert key in w.kv.store and w.stats.totals["captured_donors"] == 1

    load = LoadSpec("b", key, 0, 0, 40, [3, 4], seq=7)
    w.start_load_kv(SemShareConnectorMetadata(loads=[load]))
    assert w.stats.totals["loaded_tokens"] == 40
    assert w.build_worker_meta().loads_done == [7]  # the scheduler's blocks may be shared now
    for cache in w.kv.caches:  # [B, H, N, 2D]
        got = torch.cat([cache[3], cache[4]], dim=1)[:, :40]
        want = torch.cat([cache[1], cache[2]], dim=1)[:, :40]
        assert torch.equal(got, want)
    assert w.get_block_ids_with_load_errors() == set()

    # positions [BS, BS + 10) failed: their one block is reported, and "c" is never captured
    w.start_load_kv(SemShareConnectorMetadata(failed_loads=[FailedLoad("c", BS, 10, [5, 6])]))
    assert w.get_block_ids_with_load_errors() == {6}
    assert w.stats.totals["load_failures"] == 1
    other = DonorKey("", "c")
    w.start_load_kv(
        SemShareConnectorMetadata(captures=[CaptureSpec("c", other, list(range(20)), [5])])
    )
    assert w.get_finished(set()) == ({"c"}, None) and other not in w.kv.store

    # the donor is gone before its load: blocks failed, donor reported bad
    w.start_load_kv(
        SemShareConnectorMetadata(
            evictions=[key], loads=[LoadSpec("e", key, 0, 0, 40, [6, 7], seq=8)]
        )
    )
    assert key not in w.kv.store and w.get_block_ids_with_load_errors() == {6, 7}
    assert w.stats.totals["load_failures"] == 2
    meta = w.build_worker_meta()
    assert meta.bad_donors == [other, key]
    assert meta.loads_done == [8]  # ran, and failed: in the same output
    assert "fallbacks" not in w.stats.totals
    w.shutdown()


def test_a_fault_in_a_load_never_reaches_vllm(monkeypatch):
    """An unexpected fault (here, marking prompt logprobs) is stopped at the callback: counted as
    a fallback, and the load's blocks are reported failed, since vLLM counts them as loaded."""
    from semshare_vllm.worker import loads

    def boom(*a):
        raise RuntimeError("boom")

    w = registered_worker(monkeypatch)
    monkeypatch.setattr(loads, "mark_served_rows", boom)
    w.start_load_kv(
        SemShareConnectorMetadata(
            loads=[LoadSpec("b", DonorKey("", "d"), 0, 0, 40, [3, 4], mark_logprobs_until=40)]
        )
    )
    assert w.get_block_ids_with_load_errors() == {3, 4}
    assert w.stats.totals["fallbacks"] == 1
    w.shutdown()


def test_a_semantic_load_from_the_pool_reads_the_pool_through_its_own_offsets(monkeypatch):
    """Issue 19, item 1: the paged cache is stride-permuted (vLLM's default GPU layout: a
    [B, H, N, 2D] view of [B, N, H, 2D] memory) while the host pool is contiguous, so staging the
    pool's pages with the cache's offsets fails, and the donor was reported bad (and dropped).
    A semantic load from the pool must move each aligned row to its place, as a copy would."""
    from semshare_vllm.worker.repair import Repairer

    w = registered_worker(monkeypatch)
    key = captured_donor(w)
    assert w.captures.held(key) is None  # the donor is read from the pool, not its blocks
    assert w.kv.store.pool[0].stride() != w.kv.caches[0].stride()
    # No rotation (same positions) and no repair: only where the rows land is checked.
    w.kv.repairer = Repairer(None, None, w.kv.layout.offsets(w.kv.caches[0]))
    donor_pos = list(range(40))
    donor_pos[5] = -1  # one unaligned position: left for the recompute
    spec = LoadSpec("b", key, 0, 0, 40, [3, 4], donor_pos=donor_pos)
    w.start_load_kv(SemShareConnectorMetadata(loads=[spec]))
    assert w.get_block_ids_with_load_errors() == set()
    assert w.stats.totals["loaded_tokens"] == 40 and not w.report.bad_donors
    for cache in w.kv.caches:  # [B, H, N, 2D]
        got = torch.cat([cache[3], cache[4]], dim=1)[:, :40]
        want = torch.cat([cache[1], cache[2]], dim=1)[:, :40]
        keep = [p for p in range(40) if p != 5]
        assert torch.equal(got[:, keep], want[:, keep])
    w.shutdown()


def test_an_alignment_longer_than_its_claim_fails_the_load_and_writes_nothing(monkeypatch):
    """The CPU page path writes whole target blocks: an alignment reaching past the claimed
    positions (a planning bug) must not write there; the load fails and vLLM computes."""
    from semshare_vllm.worker.repair import Repairer

    w = registered_worker(monkeypatch)
    key = captured_donor(w)
    w.kv.repairer = Repairer(None, None, w.kv.layout.offsets(w.kv.caches[0]))
    before = [c.clone() for c in w.kv.caches]
    spec = LoadSpec("b", key, 0, 0, 30, [3, 4], donor_pos=list(range(40)))  # 40 for 30
    w.start_load_kv(SemShareConnectorMetadata(loads=[spec]))
    assert w.get_block_ids_with_load_errors() == {3}  # the claim's block: vLLM computes it
    assert w.stats.totals["load_failures"] == 1
    assert all(torch.equal(c, b) for c, b in zip(w.kv.caches, before))
    w.shutdown()


class _FakeRunner:
    """The layer runner's part in a repair, without a model: each of 4 layers shows the
    selection what it measured (relative deviation, squared as the probe measures it, rising
    from 0.1 to 0.5 with the position)."""

    layers = [None] * 4

    def __init__(self):
        self.events = []  # ("layer", i) as each layer runs; ("ready", i) where it waits

    def recompute(self, token_ids, block_ids, selection, context=None, donor_kv_ready=None):
        from semshare_vllm.recompute.layer_runner import RecomputeResult
        from semshare_vllm.recompute.policy import LayerProbe

        pos, per_layer = selection.start(), []
        for layer in range(4):
            if donor_kv_ready is not None and layer == donor_kv_ready[0]:
                self.events.append(("ready", layer))
                if not donor_kv_ready[1]():
                    return RecomputeResult(pos, None, per_layer, stopped=True)
            self.events.append(("layer", layer))
            per_layer.append(len(pos))
            want = selection.wants_probe(layer)[0]
            dev = np.linspace(0.1, 0.5, len(pos)) ** 2 if want else None
            keep = selection.after_layer(LayerProbe(layer, pos, dev, None))
            pos = pos if keep is None else pos[keep]
        return RecomputeResult(pos, None, per_layer)


def repairing_worker(monkeypatch):
    from semshare_vllm.config import SemShareConfig
    from semshare_vllm.worker.repair import Repairer

    w = registered_worker(monkeypatch)
    w.config = w.loads.config = SemShareConfig(recompute_policy="cacheblend", recompute_ratio=0.25)
    key = captured_donor(w)
    w.kv.repairer = Repairer(_FakeRunner(), None, w.kv.layout.offsets(w.kv.caches[0]))
    w.build_worker_meta()  # the pool's capacity, reported once
    spec = LoadSpec("b", key, 0, 0, 40, [3, 4], seq=7, policy="cacheblend")
    spec.token_ids = list(range(40))
    return w, spec


def test_a_repaired_load_reports_what_its_recompute_did(monkeypatch):
    """The figures of the request's provenance: the share of the loaded tokens' layer work
    recomputed, and the deviation the policy measured before and after its choice."""
    w, spec = repairing_worker(monkeypatch)
    w.start_load_kv(SemShareConnectorMetadata(loads=[spec]))
    assert w.get_block_ids_with_load_errors() == set()
    (figures,) = w.build_worker_meta().repairs
    assert (figures.req_id, figures.seq) == ("b", 7)
    # CacheBlend: every position through the check layer (1), then the top quarter
    assert figures.recompute_share == (40 + 40 + 10 + 10) / (4 * 40)
    assert figures.deviation_before == pytest.approx(0.3)  # the mean over the loaded tokens
    # the 10 worst recomputed (their own KV now): what is left is the 30 others'
    assert figures.deviation_after == pytest.approx(np.linspace(0.1, 0.5, 40)[:30].sum() / 40)
    w.shutdown()


def test_a_repair_another_rank_failed_reports_no_figures(monkeypatch):
    """Under tensor parallelism the ranks agree after the repair: one that failed elsewhere is
    recomputed by vLLM, and this rank's figures must not describe the request."""
    from semshare_vllm.vllm_compat import tensor_parallel

    w, spec = repairing_worker(monkeypatch)
    answers = iter([True, False])  # the copy agreed on, the repair failed on another rank
    monkeypatch.setattr(tensor_parallel, "all_agree", lambda ok: ok and next(answers))
    w.start_load_kv(SemShareConnectorMetadata(loads=[spec]))
    assert w.get_block_ids_with_load_errors() == {3, 4}
    meta = w.build_worker_meta()
    assert meta.repairs == [] and meta.deviations == [] and meta.loads_done == [7]
    assert w.stats.totals["tp_peer_failures"] == 1
    w.shutdown()


def test_the_prompt_logprob_rows_of_a_failed_load_are_restarted_before_the_step(monkeypatch):
    """The scheduler names the requests whose marked load failed: the worker has the runner
    forget their rows before the step in which vLLM computes their prompt again."""
    from semshare_vllm.worker import loads

    runners = []
    monkeypatch.setattr(loads.model_hook, "loaded_runner", lambda cfg: runners[-1])
    monkeypatch.setattr(loads, "restart_rows", lambda runner, req_id: runner.append(req_id) or 1)
    w = registered_worker(monkeypatch)
    runners.append([])
    w.start_load_kv(SemShareConnectorMetadata(restart_logprob_rows=["a", "b"]))
    assert runners[-1] == ["a", "b"] and "fallbacks" not in w.stats.totals
    monkeypatch.setattr(loads, "restart_rows", lambda runner, req_id: False)  # unknown runner
    w.start_load_kv(SemShareConnectorMetadata(restart_logprob_rows=["c"]))
    assert w.stats.totals["fallbacks"] == 1
    w.shutdown()


def semantic_repair(monkeypatch, donor_pos):
    """``repairing_worker``'s load as a semantic one (no rotation: ``rope`` None): on CPU its
    move runs beside the recompute."""
    from types import SimpleNamespace

    w, spec = repairing_worker(monkeypatch)
    spec.donor_pos = donor_pos
    w.kv.repairer.runner.layers = [SimpleNamespace(cache=w.kv.caches[0])] + [None] * 3
    before = [c.clone() for c in w.kv.caches]
    return w, spec, before


def test_a_semantic_load_is_moved_beside_layer_0_and_waited_for_before_layer_1(monkeypatch):
    """Layer 0 recomputes every loaded position and reads no donor KV: the move of layers 1 and
    up runs meanwhile on the side thread, and never writes layer 0 (the recompute owns it);
    the recompute waits for it before layer 1, and the request's rows are the donor's there."""
    w, spec, before = semantic_repair(monkeypatch, list(range(40)))
    w.start_load_kv(SemShareConnectorMetadata(loads=[spec]))
    assert w.get_block_ids_with_load_errors() == set()
    assert w.kv.repairer.runner.events[:3] == [("layer", 0), ("ready", 1), ("layer", 1)]
    layer0, layer1 = w.kv.caches  # [B, H, N, 2D]
    assert torch.equal(layer0, before[0])
    got = torch.cat([layer1[3], layer1[4]], dim=1)[:, :40]
    assert torch.equal(got, torch.cat([layer1[1], layer1[2]], dim=1)[:, :40])
    (figures,) = w.build_worker_meta().repairs
    assert figures.load_ms is not None and figures.recompute_share == 100 / 160
    assert w.stats.totals["loaded_tokens"] == 40
    w.shutdown()


def test_a_move_that_fails_stops_the_repair_before_the_layers_that_read_it(monkeypatch):
    """The donor holds 64 positions, the alignment reads past them: the move fails on the side
    thread, the recompute stops before layer 1, and the load is reported failed (vLLM computes
    it) with no figures; the donor is reported bad once, the failure counted once."""
    w, spec, _ = semantic_repair(monkeypatch, list(range(60, 100)))
    key = spec.key
    w.start_load_kv(SemShareConnectorMetadata(loads=[spec]))
    assert w.get_block_ids_with_load_errors() == {3, 4}
    assert w.kv.repairer.runner.events == [("layer", 0), ("ready", 1)]
    assert w.stats.totals["load_failures"] == 1 and "loaded_tokens" not in w.stats.totals
    assert "recompute_failures" not in w.stats.totals
    meta = w.build_worker_meta()
    assert meta is not None and not meta.repairs and meta.bad_donors == [key]
    w.shutdown()


def test_a_repair_over_blocks_a_load_failed_to_write_is_not_run(monkeypatch):
    """With async scheduling the next step is scheduled before a failed load comes back to
    vLLM: a request may take the failed blocks as vLLM's own prefix hit. A repair attending
    over them (here: B's, behind A's failed block 5) is not run but reported failed too, in the
    step after the failure as in the same one; once vLLM has had the failure, repairs run."""
    w, first = repairing_worker(monkeypatch)
    key = first.key

    def b_behind_block_5(req_id):
        spec = LoadSpec(req_id, key, BS, BS, 8, [5, 6], policy="cacheblend")
        spec.token_ids = list(range(40))
        return spec

    w.start_load_kv(SemShareConnectorMetadata(failed_loads=[FailedLoad("a", 0, BS, [5])]))
    assert w.get_block_ids_with_load_errors() == {5}  # step N: A's block, reported
    w.start_load_kv(SemShareConnectorMetadata(loads=[b_behind_block_5("b")]))
    assert w.get_block_ids_with_load_errors() == {6}  # step N + 1: B's claim not repaired
    assert w.stats.totals["loads_behind_unwritten_prefix"] == 1
    assert w.build_worker_meta().repairs == []  # no repair to report
    w.start_load_kv(SemShareConnectorMetadata())  # vLLM has rewound A and uncached block 5
    assert w.get_block_ids_with_load_errors() == set()
    w.start_load_kv(SemShareConnectorMetadata(loads=[b_behind_block_5("c")]))
    assert w.get_block_ids_with_load_errors() == set()
    assert [r.req_id for r in w.build_worker_meta().repairs] == ["c"]
    w.shutdown()


def test_a_persisted_donor_keeps_its_prompt_length(monkeypatch, tmp_path):
    """The capture carries how many of the donor's tokens were its prompt; its file keeps it,
    so a restart finds and aligns the donor by its prompt, as before the restart."""
    from semshare_vllm.store import donor_file

    w = registered_worker(monkeypatch, persist_root=tmp_path)
    captured_donor(w, num_prompt_tokens=33)
    w.kv.store.flush()
    (path,) = tmp_path.iterdir()
    header = donor_file.read_header(path)
    assert header.token_ids == list(range(40)) and header.num_prompt_tokens == 33
    w.shutdown()


def test_a_reset_drops_every_donor_and_capture_and_persists_nothing_after(monkeypatch, tmp_path):
    """``SemShareConnectorMetadata.reset`` (vLLM reset the connector, e.g. around a weight
    update): the donors held, the capture in flight and the capture sent with the reset are all
    dropped, their blocks freed; the donor files go and nothing is written after."""
    w = registered_worker(monkeypatch, persist_root=tmp_path)
    kept = captured_donor(w)
    w.kv.store.flush()
    assert kept in w.kv.store and list(tmp_path.iterdir())

    flying = DonorKey("", "e")  # captured, its copy started, not reaped
    w.start_load_kv(
        SemShareConnectorMetadata(captures=[CaptureSpec("e", flying, list(range(30)), [3])])
    )
    w.start_captures()
    late = CaptureSpec("f", DonorKey("", "f"), list(range(30)), [4])  # sent with the reset
    # as the scheduler sends it: every donor it knew evicted, with the reset
    evictions = [kept, flying]
    w.start_load_kv(SemShareConnectorMetadata(evictions, captures=[late], reset=True))
    assert w.get_finished({"f"}) == ({"e", "f"}, None)  # every held block freed
    assert not w.captures.jobs and w.kv.store.used_bytes == 0
    w.kv.store.flush()  # the deletes, on the store's disk thread
    assert not list(tmp_path.iterdir()) and w.kv.store.persist_root is None
    assert w.disabled is None  # it goes on: a donor captured now is kept, in memory only
    again = captured_donor(w)
    assert again in w.kv.store and not list(tmp_path.iterdir())


def test_weights_updated_between_steps_drop_every_donor_until_the_scheduler_resets(
    monkeypatch, tmp_path
):
    """The model's weights updated in place with no connector reset (``weight_updates``): the
    next step's load of a donor of before fails (vLLM computes its tokens), the capture in
    flight and the step's captures are dropped (their blocks freed), the files go and nothing
    is written after; the scheduler is told once. Captures stay refused until its reset."""
    from semshare_vllm.vllm_compat import weight_updates

    w = registered_worker(monkeypatch, persist_root=tmp_path)
    kept = captured_donor(w)
    w.kv.store.flush()
    assert kept in w.kv.store and list(tmp_path.iterdir())
    flying = DonorKey("", "e")
    w.start_load_kv(
        SemShareConnectorMetadata(captures=[CaptureSpec("e", flying, list(range(30)), [3])])
    )
    w.start_captures()

    weight_updates.changed()  # e.g. a training loop's load_weights, between two steps
    late = CaptureSpec("f", DonorKey("", "f"), list(range(30)), [4])
    load = LoadSpec("b", kept, 0, 0, 40, [5, 6], seq=3)
    w.start_load_kv(SemShareConnectorMetadata(captures=[late], loads=[load]))
    assert w.get_block_ids_with_load_errors() == {5, 6}  # not served: recomputed
    assert w.get_finished({"f"}) == ({"e", "f"}, None)  # every held block freed
    assert not w.captures.jobs and w.kv.store.used_bytes == 0
    meta = w.build_worker_meta()
    assert meta.weights_changed and w.stats.totals["weight_updates"] == 1
    w.kv.store.flush()
    assert not list(tmp_path.iterdir())
    assert not w.build_worker_meta()  # said once

    # a step scheduled before the scheduler heard: its captures are refused too
    w.start_load_kv(
        SemShareConnectorMetadata(captures=[CaptureSpec("g", DonorKey("", "g"), [1] * 20, [7])])
    )
    assert w.get_finished({"g"}) == ({"g"}, None) and not w.captures.jobs
    w.start_load_kv(SemShareConnectorMetadata([kept, flying], reset=True))  # its answer
    again = captured_donor(w)  # kept from now on, in memory only
    assert again in w.kv.store
    w.kv.store.flush()
    assert not list(tmp_path.iterdir()) and w.disabled is None
    w.shutdown()


def test_captures_whose_blocks_vllm_got_back_are_copied_before_the_step_writes(monkeypatch):
    """vLLM reset its prefix cache and got back the blocks of a capture not yet copied
    (``captures_released``): the next step may load into them. The capture is copied first, so
    the donor holds the request's KV, not what the load wrote."""
    w = registered_worker(monkeypatch)
    other = DonorKey("", "o")  # a donor in blocks 5 and 6, to load from
    w.start_load_kv(
        SemShareConnectorMetadata(captures=[CaptureSpec("o", other, list(range(40)), [5, 6])])
    )
    w.start_captures()
    w.flush_captures()
    w.get_finished({"o"})
    before = [cache[[1, 2]].clone() for cache in w.kv.caches]
    key = DonorKey("", "x")  # taken, its copy not done when vLLM got its blocks 1 and 2 back
    w.start_load_kv(
        SemShareConnectorMetadata(captures=[CaptureSpec("x", key, list(range(40)), [1, 2])])
    )
    into_its_blocks = LoadSpec("y", other, 0, 0, 40, [1, 2], seq=1)
    w.start_load_kv(SemShareConnectorMetadata(loads=[into_its_blocks], captures_released=True))
    assert w.get_finished(set()) == ({"x"}, None)
    w.start_load_kv(SemShareConnectorMetadata(loads=[LoadSpec("z", key, 0, 0, 40, [3, 4])]))
    for cache, was in zip(w.kv.caches, before):  # [B, H, N, 2D]
        got = torch.cat([cache[3], cache[4]], dim=1)[:, :40]
        assert torch.equal(got, torch.cat([was[0], was[1]], dim=1)[:, :40])  # x's own KV
        assert not torch.equal(cache[[1, 2]], was)  # the load did write its blocks


def test_before_sleep_unmaps_the_kv_cache_no_capture_copy_is_running(monkeypatch):
    """vLLM 0.33 calls the connector's ``unregister_kv_caches`` before sleep unmaps the KV cache:
    a capture copy still reading it (the reviewer's reading of ``EngineCore.sleep``) is waited
    for."""
    import time

    w = registered_worker(monkeypatch)
    copy_out = w.captures._copy_out

    def slow(job):
        time.sleep(0.3)
        return copy_out(job)

    monkeypatch.setattr(w.captures, "_copy_out", slow)
    key = DonorKey("", "s")
    w.start_load_kv(
        SemShareConnectorMetadata(captures=[CaptureSpec("s", key, list(range(40)), [1, 2])])
    )
    w.start_captures()
    w.wait_for_copies()
    assert w.captures.jobs[key].copy.done()
    assert w.get_finished(set()) == ({"s"}, None) and key in w.kv.store


def test_two_captures_of_one_donor_in_a_step_release_both_requests(monkeypatch):
    """Two finished requests of the same tokens (greedy siblings, a repeated prompt) can both be
    captured in one step, when the donor the first made was evicted from the catalog before the
    second came. The second capture replaced the first in the worker: the first request was
    never reported in ``finished_sending``, so vLLM kept its blocks and, with a capture pending
    forever, stopped preempting (review)."""
    w = registered_worker(monkeypatch)
    key = DonorKey("", "d")
    w.start_load_kv(
        SemShareConnectorMetadata(
            captures=[
                CaptureSpec("A", key, list(range(40)), [1, 2]),
                CaptureSpec("B", key, list(range(40)), [3, 4]),
            ]
        )
    )
    w.start_captures()
    w.flush_captures()
    released, _ = w.get_finished({"A", "B"})
    assert released == {"A", "B"}
    assert w.stats.totals.get("captured_donors") == 1  # the same KV, kept once
    assert w.kv.store.blocks(key)


def test_a_donor_evicted_and_made_again_in_one_step_leaves_no_capture_pending(monkeypatch):
    """The same through the scheduler half: A makes donor K, X's donor evicts K from a full
    store, B (A's tokens) makes K again, all before one step; every request is released and
    none is left pending (``has_pending_block_frees``: vLLM's scheduler stops preempting while
    it is true)."""
    from types import SimpleNamespace

    from support.worker import geometry

    from semshare_vllm.config import SemShareConfig
    from semshare_vllm.metadata import SemShareWorkerMetadata
    from semshare_vllm.scheduler import SemShareScheduler

    def output(finished=None, meta=None):
        return SimpleNamespace(
            finished_sending=finished, invalid_block_ids=None, kv_connector_worker_meta=meta
        )

    g = geometry()
    s = SemShareScheduler(SemShareConfig(embedder="none"), g)
    w = registered_worker(monkeypatch)
    room = SemShareWorkerMetadata(capacity_bytes=g.donor_bytes(40) + 1)  # one donor's room
    s.update_connector_output(output(meta=room))
    a, x = list(range(1, 42)), list(range(500, 541))
    for rid, tokens, blocks in (("A", a, [1, 2]), ("X", x, [3, 4]), ("B", a, [5, 6])):
        request = SimpleNamespace(
            request_id=rid,
            prompt_token_ids=tokens[:-1],
            all_token_ids=tokens,
            num_tokens=41,
            num_prompt_tokens=40,
            num_output_tokens=1,
            cache_salt=None,
            num_computed_tokens=40,
        )
        assert s.request_finished(request, blocks)[0]  # vLLM keeps its blocks for the capture
    released = set()
    for _ in range(3):
        w.start_load_kv(s.build_connector_meta(None))
        w.start_captures()
        w.flush_captures()
        finished, _ = w.get_finished(set())
        released |= finished or set()
        s.update_connector_output(output(finished, w.build_worker_meta()))
    assert released == {"A", "X", "B"}
    assert not s.has_pending_block_frees()


def test_captures_past_the_disks_backlog_stay_memory_only(monkeypatch, tmp_path):
    """With persist_dir on a disk that has stopped keeping up, captures go on (every request
    released, every donor kept in memory) and the copies queued for the disk stop growing."""
    import threading

    from semshare_vllm.store import host_store

    gate = threading.Event()
    monkeypatch.setattr(host_store.donor_file, "write", lambda *a: gate.wait(timeout=30))
    w = registered_worker(monkeypatch, persist_root=tmp_path)
    store = w.kv.store
    n = int(store.capacity_bytes // (2 * store.block_bytes))  # as many 2-block donors as fit
    for i in range(n):
        key = DonorKey("", f"d{i}")
        spec = CaptureSpec(f"r{i}", key, list(range(i, i + 40)), [1, 2])
        w.start_load_kv(SemShareConnectorMetadata(captures=[spec]))
        w.start_captures()
        w.flush_captures()
        assert w.get_finished(set())[0] == {f"r{i}"}
        assert store.blocks(key)
    skipped = w.stats.totals.get("persist_backlog_skipped", 0)
    assert 0 < skipped < n
    assert store._backlog.queued <= host_store.PERSIST_BACKLOG_FRACTION * store.capacity_bytes
    gate.set()
    store.flush()


def test_a_capture_on_another_ranks_gpu_waits_for_its_own_copies(monkeypatch):
    """On CUDA the capture's copies into the pinned pool are asynchronous, issued on the capture
    thread's stream of the cache's device. That thread's current device is 0: rank 3 waited on
    GPU 0's stream, so its donor could be marked written before its copies landed (review;
    read from the code, no GPU here). Checked with CPU stand-ins for the device calls."""
    from types import SimpleNamespace

    from semshare_vllm.worker.capture import CaptureJob, Captures

    calls = []

    class Stream:
        def __init__(self, device):
            self.device = device

        def synchronize(self):
            calls.append(("synchronize", self.device))

    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: Stream(d))
    gpu3 = torch.device("cuda", 3)
    kv = SimpleNamespace(
        stacks=[(slice(0, 2), SimpleNamespace(device=gpu3))],
        layout=SimpleNamespace(copy_blocks=lambda *a: calls.append(("copy",))),
        store=SimpleNamespace(pool=_PinnedPool(), persist_root=None, block_bytes=1),
        tier=None,
    )
    captures = Captures.__new__(Captures)
    captures.kv = kv
    spec = CaptureSpec("a", DonorKey("", "d"), list(range(40)), [1, 2])
    captures._copy_out(CaptureJob(spec, [5, 6]))
    assert calls == [("set_device", gpu3), ("copy",), ("synchronize", gpu3)]


class _PinnedPool:
    """A pinned pool's stand-in: indexing gives itself."""

    def __getitem__(self, _):
        return self

    def is_pinned(self):
        return True


def test_a_stalled_lmcache_bounds_the_puts_waiting_and_never_holds_up_shutdown():
    """A remote that answers but takes no writes (Redis at maxmemory) makes each put wait on
    LMCache's timeouts. The rows of every donor were queued without limit (review: +163 MiB for
    40 puts), and shutdown waited for all of them (40 s at 1 s a put). Rows past the backlog
    are not staged, and shutdown waits ``FLUSH_TIMEOUT_S`` at most, then drops the rest."""
    import threading
    import time

    from semshare_vllm.core.counters import StatsRecorder
    from semshare_vllm.worker.tier import Tier

    stalled = threading.Event()

    class StalledStore:
        dtype = torch.float32

        def put(self, key, token_ids, rows):
            stalled.wait(timeout=60)
            return False

        def close(self):
            pass

    rows = torch.zeros(2, 64, 2, 64)
    size = rows.numel() * rows.element_size()
    tier = Tier(StalledStore, StatsRecorder(), rank=0, backlog_bytes=4 * size)
    queued = 0
    for i in range(40):
        if tier.room(size):
            tier.put_later(DonorKey("", f"d{i}"), [i], rows.clone())
            queued += 1
    assert queued == 4
    t0 = time.monotonic()
    assert tier.flush(timeout_s=0.5) is False
    tier.close(cancel=True, wait=False)  # what shutdown does after a flush that timed out
    stalled.set()
    assert time.monotonic() - t0 < 30


def test_a_hung_lmcache_remote_holds_one_load_for_a_bounded_time(monkeypatch):
    """Crash-class review: a load whose donor only LMCache holds fetched it on the worker's
    step, and LMCache waits ``blocking_timeout_secs`` (10 s) per chunk for a remote that stopped
    answering (a partition, no reset): every such load held the step, each request's, that
    long again. A fetch now waits ``TIER_FETCH_TIMEOUT_S`` at most; while it is stuck, and for
    ``TIER_RETRY_AFTER_S`` after, fetches fail at once (the loads are recomputed)."""
    import threading
    import time

    from semshare_vllm.core.counters import StatsRecorder
    from semshare_vllm.store.base import DonorNotReadNow, DonorUnavailable
    from semshare_vllm.worker import tier as tier_module
    from semshare_vllm.worker.tier import Tier

    monkeypatch.setattr(tier_module, "TIER_FETCH_TIMEOUT_S", 0.3, raising=False)
    remote = threading.Event()
    gets = []

    class HungStore:
        dtype = torch.float32

        def get(self, key, token_ids):
            gets.append(key)
            remote.wait(timeout=5)
            return None  # as LMCache after its own timeout

        def close(self):
            pass

    layers = ["model.layers.0.self_attn.attn"]
    host = HostKVStore(1 << 20, layers, (2, 4, 16), torch.float32, "CPU_ATTN/vec/8")
    tier = Tier(HungStore, StatsRecorder(), rank=0)
    clock = SteppedClock()
    tier._fetches.clock = clock  # the retry window, stepped instead of slept through
    spec = LoadSpec("r", DonorKey("", "d"), 0, 0, 4, [0], donor_token_ids=[1, 2, 3, 4])
    try:
        t0 = time.monotonic()
        with pytest.raises(DonorNotReadNow, match="did not return within"):
            tier.fetch(spec, host)
        with pytest.raises(DonorUnavailable, match="has not returned"):
            tier.fetch(spec, host)  # no second wait, no second thread stuck
        assert time.monotonic() - t0 < 4 and len(gets) == 1  # one fetch, bounded waits
    finally:
        remote.set()
    tier._fetches._stuck.join(5)  # the hung fetch returns: "not there" (never kept)
    other = LoadSpec("s", DonorKey("", "e"), 0, 0, 4, [0], donor_token_ids=[5, 6, 7, 8])
    for load in (spec, other):
        with pytest.raises(DonorNotReadNow, match="stalled less than"):
            tier.fetch(load, host)  # a remote that just hung is not waited on again at once
    assert len(gets) == 1
    clock.now += tier_module.TIER_RETRY_AFTER_S
    with pytest.raises(DonorUnavailable, match="neither"):
        tier.fetch(other, host)  # then asked again (this one holds no such donor)
    assert len(gets) == 2
    tier.close()


def test_a_stalled_disk_fails_the_load_but_keeps_the_donor(monkeypatch, tmp_path):
    """Review of the bounded disk read: a read that stalled failed the load as a donor that
    cannot be used would, so the scheduler forgot the donor and the worker deleted its file,
    and so on for every donor read in the next 30 s: a slow mount cost every donor on it. A
    stall is transient: the load is recomputed, the donor stays (and is read again later)."""
    import threading

    from semshare_vllm.store import donor_file, host_store

    monkeypatch.setattr(host_store, "DISK_READ_TIMEOUT_S", 0.2)
    w = registered_worker(monkeypatch, persist_root=tmp_path)
    key = captured_donor(w)
    w.kv.store.flush()  # written to disk
    w.kv.store.drop_memory(key)  # then let go of in memory: a load reads the file
    disk = threading.Event()
    real_read = donor_file.read
    monkeypatch.setattr(donor_file, "read", lambda path: (disk.wait(5), real_read(path))[1])
    try:
        w.start_load_kv(
            SemShareConnectorMetadata(loads=[LoadSpec("b", key, 0, 0, 40, [3, 4], seq=9)])
        )
    finally:
        disk.set()
    assert w.get_block_ids_with_load_errors() == {3, 4}  # recomputed
    meta = w.build_worker_meta()
    assert meta.loads_done == [9] and meta.bad_donors == []  # the donor is not forgotten
    assert list(tmp_path.rglob("*.safetensors"))  # nor its file
    w.shutdown()


def test_lmcache_is_closed_only_once_no_call_of_ours_is_inside_it(monkeypatch):
    """Review of the bounded fetch: a fetch that timed out goes on in its thread, and closing
    the tier (a connector reset, shutdown) destroyed LMCache under it, whose arena LMCache frees
    by raw pointer: the fetch could then read freed memory. The store is closed once that call
    has returned (on a thread of its own: the reset does not wait for it)."""
    import threading
    import time

    from semshare_vllm.core.counters import StatsRecorder
    from semshare_vllm.store.base import DonorUnavailable
    from semshare_vllm.worker import tier as tier_module
    from semshare_vllm.worker.tier import Tier

    monkeypatch.setattr(tier_module, "TIER_FETCH_TIMEOUT_S", 0.2)
    remote, closed = threading.Event(), threading.Event()

    class HungStore:
        dtype = torch.float32

        def get(self, key, token_ids):
            remote.wait(timeout=10)
            assert not closed.is_set(), "read after close"
            return None

        def close(self):
            closed.set()

    layers = ["model.layers.0.self_attn.attn"]
    host = HostKVStore(1 << 20, layers, (2, 4, 16), torch.float32, "CPU_ATTN/vec/8")
    tier = Tier(HungStore, StatsRecorder(), rank=0)
    spec = LoadSpec("r", DonorKey("", "d"), 0, 0, 4, [0], donor_token_ids=[1, 2, 3, 4])
    with pytest.raises(DonorUnavailable):
        tier.fetch(spec, host)
    t0 = time.monotonic()
    tier.close(cancel=True, wait=False)
    assert time.monotonic() - t0 < 1 and not closed.is_set()  # not under the fetch
    remote.set()
    assert closed.wait(5)  # once it returned


@pytest.mark.parametrize("lmcache", ["holds nothing", "refuses the connection"])
def test_a_stalled_disk_with_lmcache_behind_it_keeps_the_donor(monkeypatch, tmp_path, lmcache):
    """Second review: with the LMCache tier on, a load whose disk stalled went on to LMCache,
    which did not hold the donor either, and that plain "not there" made the donor bad: the
    scheduler forgot it and its file was deleted. Review of e647fe0: the same when LMCache
    raised instead (its remote refused the connection). Whatever LMCache says, the file was
    not read: the stall is what the load reports."""
    import threading

    from semshare_vllm.core.counters import StatsRecorder
    from semshare_vllm.store import donor_file, host_store
    from semshare_vllm.worker.tier import Tier

    class LMCache:
        dtype = torch.float32

        def get(self, key, token_ids):
            if lmcache == "refuses the connection":
                raise ConnectionError("redis: connection refused")
            return None

        def close(self):
            pass

    monkeypatch.setattr(host_store, "DISK_READ_TIMEOUT_S", 0.2)
    w = registered_worker(monkeypatch, persist_root=tmp_path)
    key = captured_donor(w)
    w.kv.store.flush()
    w.kv.store.drop_memory(key)
    w.kv.tier = Tier(LMCache, StatsRecorder(), rank=0)
    disk = threading.Event()
    real_read = donor_file.read
    monkeypatch.setattr(donor_file, "read", lambda path: (disk.wait(5), real_read(path))[1])
    load = LoadSpec("b", key, 0, 0, 40, [3, 4], seq=9, donor_token_ids=list(range(40)))
    try:
        w.start_load_kv(SemShareConnectorMetadata(loads=[load]))
    finally:
        disk.set()
    assert w.get_block_ids_with_load_errors() == {3, 4}
    assert w.build_worker_meta().bad_donors == []
    assert w.stats.totals["loads_not_read_in_time"] == 1
    w.shutdown()


def test_a_read_that_came_in_late_serves_the_next_load(monkeypatch, tmp_path):
    """Second review: a donor whose file takes longer to read than the wait (a large shard on
    a slow mount) had its late read thrown away, so every load of it waited, failed and waited
    again, without end. The read that came in late is what the next load of that donor uses:
    the donor is then in memory."""
    import threading

    from semshare_vllm.store import donor_file, host_store

    monkeypatch.setattr(host_store, "DISK_READ_TIMEOUT_S", 0.2)
    w = registered_worker(monkeypatch, persist_root=tmp_path)
    key = captured_donor(w)
    w.kv.store.flush()
    w.kv.store.drop_memory(key)
    disk = threading.Event()
    real_read, reads = donor_file.read, []

    def slow_read(path):
        reads.append(path)
        disk.wait(5)
        return real_read(path)

    monkeypatch.setattr(donor_file, "read", slow_read)
    w.start_load_kv(SemShareConnectorMetadata(loads=[LoadSpec("b", key, 0, 0, 40, [3, 4])]))
    assert w.get_block_ids_with_load_errors() == {3, 4}  # the first load waited, then gave up
    disk.set()
    w.kv.store._disk.running() is None or w.kv.store._disk.running().join(5)
    w.start_load_kv(SemShareConnectorMetadata(loads=[LoadSpec("c", key, 0, 0, 40, [5, 6])]))
    assert w.get_block_ids_with_load_errors() == set() and key in w.kv.store
    for cache in w.kv.caches:  # the late read's pages, loaded
        assert torch.equal(cache[5][:, :BS], cache[1][:, :BS])
    assert len(reads) == 1 and w.build_worker_meta().bad_donors == []
    w.shutdown()
