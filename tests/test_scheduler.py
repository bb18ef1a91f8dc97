"""The scheduler half with hand-built requests (no engine)."""

from types import SimpleNamespace

import torch

from semshare_vllm import donor_file
from semshare_vllm.config import SemShareConfig
from semshare_vllm.donor_index import donor_id_for
from semshare_vllm.geometry import KVGeometry
from semshare_vllm.metadata import DonorKey, SemShareWorkerMetadata
from semshare_vllm.scheduler import SemShareScheduler

BS = 32
LAYERS = ("l0", "l1")


def geometry(**kw):
    base = dict(layer_names=LAYERS, block_size=BS, num_kv_heads=2, head_size=8,
                dtype=torch.float32, tp_size=1, fingerprint="fp")
    base.update(kw)
    return KVGeometry(**base)


def request(req_id, tokens, salt=None, computed=0, outputs=()):
    all_ids = list(tokens) + list(outputs)
    return SimpleNamespace(request_id=req_id, prompt_token_ids=list(tokens), all_token_ids=all_ids,
                           num_tokens=len(all_ids), num_prompt_tokens=len(tokens),
                           cache_salt=salt, num_computed_tokens=computed)


class Blocks:
    def __init__(self, ids):
        self.ids = ids

    def get_block_ids(self):
        return (self.ids,)


def finish(s, tokens, salt=None, outputs=(7, 8)):
    r = request("done", tokens, salt, outputs=outputs)
    r.num_computed_tokens = r.num_tokens - 1
    return s.request_finished(r, list(range(100, 100 + r.num_tokens // BS + 1)))


def test_capture_then_claim_whole_blocks_leaving_one_token():
    s = SemShareScheduler(SemShareConfig(), geometry())
    donor = list(range(200))
    assert finish(s, donor) == (True, None)
    meta = s.build_connector_meta(None)
    assert [c.req_id for c in meta.captures] == ["done"] and len(meta.captures[0].token_ids) == 201
    assert s.has_pending_block_frees()
    s.update_connector_output(SimpleNamespace(finished_sending={"done"},
                                              kv_connector_worker_meta=None))
    assert not s.has_pending_block_frees()

    target = request("t", donor[:150] + [1, 2, 3])
    assert s.get_num_new_matched_tokens(target, 0) == (128, False)
    s.update_state_after_alloc(target, Blocks(list(range(10, 15))), 128)
    load = s.build_connector_meta(None).loads[0]
    assert (load.src_start, load.dst_start, load.num_tokens) == (0, 0, 128)
    assert load.block_ids == [10, 11, 12, 13, 14]
    # Beyond vLLM's own prefix-cache hit only:
    assert s.get_num_new_matched_tokens(target, 64) == (64, False)
    # The whole prompt is cached: still leave the last token to compute.
    assert s.get_num_new_matched_tokens(request("u", donor[:160]), 0) == (128, False)
    assert s.get_num_new_matched_tokens(request("v", donor[:161]), 0) == (160, False)
    assert s.stats.totals["hits"] == 1 and s.stats.totals["hit_tokens"] == 128


def test_min_reuse_and_namespace():
    s = SemShareScheduler(SemShareConfig(min_reuse_tokens=64), geometry())
    finish(s, list(range(100)), salt="a")
    assert s.get_num_new_matched_tokens(request("t", list(range(40))), 0) == (0, False)
    assert s.get_num_new_matched_tokens(request("t", list(range(100)), salt="b"), 0) == (0, False)
    assert s.get_num_new_matched_tokens(request("t", list(range(50)), salt="a"), 0) == (0, False)
    assert s.get_num_new_matched_tokens(request("t", list(range(80)), salt="a"), 0) == (64, False)


def test_no_capture_when_short_covered_disabled_or_unsupported():
    s = SemShareScheduler(SemShareConfig(min_donor_tokens=40), geometry())
    assert finish(s, list(range(30))) == (False, None)
    assert finish(s, list(range(100))) == (True, None)
    assert finish(s, list(range(90)), outputs=()) == (False, None)  # already covered
    assert finish(SemShareScheduler(SemShareConfig(capture=False), geometry()),
                  list(range(100))) == (False, None)
    off = SemShareScheduler(SemShareConfig(), geometry(unsupported="hybrid"))
    assert finish(off, list(range(100))) == (False, None)
    assert off.get_num_new_matched_tokens(request("t", list(range(100))), 0) == (0, False)


def test_capacity_evicts_lru_and_tells_the_worker():
    per_token = geometry().bytes_per_token
    s = SemShareScheduler(SemShareConfig(host_store_bytes=300 * per_token), geometry())  # 2 donors
    finish(s, list(range(100)), outputs=())
    finish(s, list(range(1000, 1100)), outputs=())
    s.build_connector_meta(None)
    finish(s, list(range(2000, 2100)), outputs=())
    meta = s.build_connector_meta(None)
    first = DonorKey("", donor_id_for("", list(range(99))))
    assert meta.evictions == [first]
    assert s.get_num_new_matched_tokens(request("t", list(range(100))), 0) == (0, False)


def test_bad_donor_reported_by_worker_is_forgotten():
    s = SemShareScheduler(SemShareConfig(), geometry())
    finish(s, list(range(100)), outputs=())
    s.build_connector_meta(None)
    key = DonorKey("", donor_id_for("", list(range(99))))
    s.update_connector_output(SimpleNamespace(finished_sending=None,
                                              kv_connector_worker_meta=SemShareWorkerMetadata([key])))
    assert key not in s.index
    assert s.build_connector_meta(None).evictions == [key]


def test_restore_skips_truncated_and_foreign_files(tmp_path):
    root = tmp_path / "fp"
    kv = torch.zeros(len(LAYERS), 2, 64, 2, 8)
    good = list(range(64))
    good_id = donor_id_for("ns", good)
    donor_file.write(donor_file.donor_path(root, good_id, 0, 1), "ns", good_id, good,
                     list(LAYERS), "L", kv)
    cut_id = donor_id_for("ns", list(range(500, 564)))
    cut = donor_file.donor_path(root, cut_id, 0, 1)
    donor_file.write(cut, "ns", cut_id, list(range(500, 564)), list(LAYERS), "L", kv)
    cut.write_bytes(cut.read_bytes()[:-100])
    liar = donor_file.donor_path(root, "0" * 32, 0, 1)  # contents do not match its id
    donor_file.write(liar, "ns", "0" * 32, list(range(64)), list(LAYERS), "L", kv)
    (root / "junk.tp0of1.safetensors").write_bytes(b"\x00" * 3)

    s = SemShareScheduler(SemShareConfig(persist_dir=str(tmp_path)), geometry())
    assert s.stats.totals["donors_restored"] == 1
    assert s.stats.totals["persisted_skipped"] == 3
    assert s.get_num_new_matched_tokens(request("t", good + [1], salt="ns"), 0) == (64, False)
    assert s.get_num_new_matched_tokens(request("t", list(range(500, 565)), salt="ns"), 0) == (0, False)


def test_a_connector_fault_never_reaches_the_request():
    """A fault inside lookup or capture is counted and the request is simply computed."""
    s = SemShareScheduler(SemShareConfig(), geometry())
    finish(s, list(range(100)))
    broken = request("x", list(range(100)))
    broken.all_token_ids = None  # anything that makes our code raise
    assert s.get_num_new_matched_tokens(broken, 0) == (0, False)
    broken.num_computed_tokens = 99
    assert s.request_finished(broken, [1, 2, 3, 4]) == (False, None)
    assert s.stats.totals["fallbacks"] == 2
    assert [c.req_id for c in s.build_connector_meta(None).captures] == ["done"]  # not "x"


def test_a_fault_after_vllm_took_the_claim_has_the_worker_report_the_blocks_failed():
    """vLLM counts claimed tokens as loaded once it allocated for them: a fault while planning
    the load must still reach the worker, as a load that reports its blocks failed."""
    s = SemShareScheduler(SemShareConfig(), geometry())
    donor = list(range(200))
    finish(s, donor)
    target = request("t", donor[:150] + [1, 2, 3])
    assert s.get_num_new_matched_tokens(target, 0) == (128, False)
    s.index = None                                  # anything that makes our planning raise
    s.update_state_after_alloc(target, Blocks(list(range(10, 15))), 128)
    load = s.build_connector_meta(None).loads[0]
    assert load.policy == "fail" and (load.dst_start, load.num_tokens) == (0, 128)
    assert s.stats.totals["fallbacks"] == 1
