"""The scheduler half with hand-built requests (no engine)."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from support.scheduler import LAYERS, Blocks, finish, geometry, request

from semshare_vllm.config import SemShareConfig
from semshare_vllm.core.counters import StatsRecorder
from semshare_vllm.core.keys import DonorKey, donor_id_for
from semshare_vllm.metadata import SemShareHandshake, SemShareWorkerMetadata
from semshare_vllm.scheduler import SemShareScheduler
from semshare_vllm.store import donor_file


def test_capture_then_claim_whole_blocks_leaving_one_token():
    s = SemShareScheduler(SemShareConfig(), geometry())
    donor = list(range(200))
    assert finish(s, donor)[0] is True
    meta = s.build_connector_meta(None)
    assert [c.req_id for c in meta.captures] == ["done"] and len(meta.captures[0].token_ids) == 201
    assert meta.captures[0].num_prompt_tokens == 200  # kept with the donor's file
    assert s.has_pending_block_frees()
    s.update_connector_output(
        SimpleNamespace(finished_sending={"done"}, kv_connector_worker_meta=None)
    )
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
    assert finish(s, list(range(30)))[0] is False
    assert finish(s, list(range(100)))[0] is True
    assert finish(s, list(range(90)), outputs=())[0] is False  # already covered
    assert (
        finish(SemShareScheduler(SemShareConfig(capture=False), geometry()), list(range(100)))[0]
        is False
    )
    off = SemShareScheduler(SemShareConfig(), geometry(unsupported="hybrid"))
    assert finish(off, list(range(100)))[0] is False
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
    s.update_connector_output(
        SimpleNamespace(
            finished_sending=None, kv_connector_worker_meta=SemShareWorkerMetadata([key])
        )
    )
    assert key not in s.index
    assert s.build_connector_meta(None).evictions == [key]


def persisted(root, tokens, num_prompt_tokens=None):
    """A donor file of ``tokens`` in namespace "ns" under ``root``: its id and path."""
    donor_id = donor_id_for("ns", tokens)
    path = donor_file.donor_path(root, donor_id, 0, 1)
    kv = torch.zeros(len(LAYERS), 2, 64, 2, 8)
    donor_file.write(path, "ns", donor_id, tokens, list(LAYERS), "L", kv, num_prompt_tokens)
    return donor_id, path


def test_restore_skips_truncated_and_foreign_files(tmp_path):
    root = tmp_path / "fp"
    kv = torch.zeros(len(LAYERS), 2, 64, 2, 8)
    good = list(range(64))
    good_id = donor_id_for("ns", good)
    donor_file.write(
        donor_file.donor_path(root, good_id, 0, 1), "ns", good_id, good, list(LAYERS), "L", kv
    )
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
    other = request("t", list(range(500, 565)), salt="ns")
    assert s.get_num_new_matched_tokens(other, 0) == (0, False)


def test_a_restored_donor_keeps_its_prompt_apart_from_its_output(tmp_path):
    """A donor is found and aligned by its prompt (its grams, its embedding, its alignment
    features), not by the output it generated. Its file kept the token ids only, so after a
    restart every token counted as its prompt: the same donor was found and aligned by text
    it had generated. Files written before the prompt length was kept still restore (all of
    their tokens the prompt, as before)."""
    tokens, prompt, older = list(range(64)), 50, list(range(100, 164))
    donor_id, path = persisted(tmp_path / "fp", tokens, prompt)
    assert donor_file.read_header(path).num_prompt_tokens == prompt
    older_id, _ = persisted(tmp_path / "fp", older)
    s = SemShareScheduler(SemShareConfig(persist_dir=str(tmp_path)), geometry())
    assert s.stats.totals["donors_restored"] == 2
    assert s.index.get(DonorKey("ns", donor_id)).prompt_token_ids == tokens[:prompt]
    assert s.index.get(DonorKey("ns", older_id)).prompt_token_ids == older


@pytest.mark.parametrize("value", ["0", "65", "-3", "12.7", "abc", 1e999, True, 12])
def test_a_donor_file_with_a_prompt_length_it_cannot_hold_is_skipped(tmp_path, value):
    """Hand-made or corrupt: a prompt length that is not what ``write`` writes (digits, 1 to
    the number of tokens) makes the file corrupt; the restore skips it and goes on (an
    overflowing number, uncaught, would stop the whole restore)."""
    import json
    import struct

    _, path = persisted(tmp_path / "fp", list(range(64)), 50)
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header["__metadata__"]["prompt_tokens"] = value
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])
    with pytest.raises(donor_file.CorruptDonorFile):
        donor_file.read_header(path)
    persisted(tmp_path / "fp", list(range(100, 164)))
    s = SemShareScheduler(SemShareConfig(persist_dir=str(tmp_path)), geometry())
    assert s.stats.totals["donors_restored"] == 1 and s.stats.totals["persisted_skipped"] == 1


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
    s.catalog.index = None  # anything that makes our planning raise
    s.update_state_after_alloc(target, Blocks(list(range(10, 15))), 128)
    meta = s.build_connector_meta(None)
    assert not meta.loads and len(meta.failed_loads) == 1
    load = meta.failed_loads[0]
    assert (load.start, load.num_tokens) == (0, 128) and load.block_ids == list(range(10, 15))
    assert s.stats.totals["fallbacks"] == 1


def test_a_fault_behind_a_local_prefix_hit_reports_the_claimed_blocks_not_the_shared_ones():
    """vLLM calls update_state_after_alloc before it sets num_computed_tokens (0 then, for a
    new request): the failed range is where the claim starts, after vLLM's own 64-token hit."""
    s = SemShareScheduler(SemShareConfig(), geometry())
    donor = list(range(200))
    finish(s, donor)
    target = request("t", donor[:150] + [1, 2, 3])
    assert s.get_num_new_matched_tokens(target, 64) == (64, False)
    s.catalog.index = None
    s.update_state_after_alloc(target, Blocks(list(range(10, 15))), 64)
    meta = s.build_connector_meta(None)
    assert not meta.loads and len(meta.failed_loads) == 1
    load = meta.failed_loads[0]
    assert (load.start, load.num_tokens) == (64, 64)


def scoring_request(req_id, tokens, limit):
    r = request(req_id, tokens)
    r.kv_transfer_params = {"semshare_reuse_limit": limit} if limit is not None else None
    r.sampling_params = SimpleNamespace(prompt_logprobs=0)
    r.skip_reading_prefix_cache = True  # what vLLM sets for prompt logprobs
    return r


def test_prompt_logprobs_requests_are_served_only_up_to_their_reuse_limit():
    s = SemShareScheduler(SemShareConfig(), geometry())
    donor = list(range(200))
    finish(s, donor)
    s.build_connector_meta(None)
    # No limit: vLLM would drop any claim; no lookup, and the flag is left as vLLM set it.
    plain = scoring_request("p", donor[:180], None)
    assert s.get_num_new_matched_tokens(plain, 0) == (0, False)
    assert plain.skip_reading_prefix_cache and "lookups" not in s.stats.totals
    # A limit: the claim ends on the block at or below it; the flag is off only for vLLM's
    # check right after asking us, and the worker is told to mark the served rows.
    scored = scoring_request("s", donor[:180], 100)
    assert s.get_num_new_matched_tokens(scored, 0) == (96, False)
    assert not scored.skip_reading_prefix_cache
    s.update_state_after_alloc(scored, Blocks(list(range(10, 16))), 96)
    assert scored.skip_reading_prefix_cache
    load = s.build_connector_meta(None).loads[0]
    assert (load.num_tokens, load.mark_logprobs_until) == (96, 96)
    # Offered but not allocated this step: set back at the end of the step.
    again = scoring_request("a", donor[:180], 100)
    s.get_num_new_matched_tokens(again, 0)
    s.build_connector_meta(None)
    assert again.skip_reading_prefix_cache
    # A limit alone (no prompt logprobs) only shortens the claim.
    short = request("l", donor[:180])
    short.kv_transfer_params = {"semshare_reuse_limit": 70}
    assert s.get_num_new_matched_tokens(short, 0) == (64, False)
    # A malformed limit is ignored.
    short.kv_transfer_params = {"semshare_reuse_limit": "ten"}
    assert s.get_num_new_matched_tokens(short, 0) == (160, False)


def test_a_request_with_a_reuse_limit_makes_a_donor_of_its_prompt_up_to_the_limit():
    """Review: a request scoring a continuation (prompt + continuation, the limit at the
    prompt's end) was kept as a donor of all of it, so later prompts found and aligned the
    continuation (the bench's reference answer). Its donor is the prompt as if it ended at
    the limit, as it is searched and aligned."""
    s = SemShareScheduler(SemShareConfig(), geometry())
    prompt = list(range(300, 500))
    scored = scoring_request("s", prompt + list(range(900, 960)), len(prompt) - 1)
    scored.num_computed_tokens = scored.num_tokens
    s.request_finished(scored, list(range(100, 110)))
    (capture,) = s.build_connector_meta(None).captures
    assert capture.token_ids == prompt
    assert s.index.get(capture.key).num_prompt_tokens == len(prompt)


class FakeFeed:
    """Stands in for ``SharedDonorFeed`` (its own tests run on a real redis-server); counts, as
    the real one does, into the recorder it is handed."""

    def __init__(self, arrivals=(), stats=None):
        self.published, self.arrivals, self.closed = [], list(arrivals), False
        self.stats = stats

    def publish(self, record):
        self.published.append(record)

    def take_arrived(self):
        if self.arrivals and self.stats is not None:
            self.stats.add("shared_index_outages")
            self.stats.add("shared_records_forged", 2)
        out, self.arrivals = self.arrivals, []
        return out

    def close(self, timeout_s=None):
        self.closed = True


def shared_config():
    return SemShareConfig(
        kv_tier="lmcache",
        lmcache_remote_url="redis://h:1",
        shared_index_url="redis://h:1",
        shared_index_secret="s",
    )


class FakeDiscovery:
    """Embeds nothing; registrations wait in ``registered`` (the real service is tested in
    test_discovery)."""

    failed = None
    embedder_id = "embedder-x"

    def __init__(self):
        from semshare_vllm.discovery.vector_index import VectorIndex

        self.index = VectorIndex(kind="exact")
        self.registered = []
        self.on_drop = []  # each registration's, as the backlog would call it
        self.holds_tokens = []

    def register(self, key, serial, tokens_of, then=None, *, holds_tokens=0, on_drop=None):
        self.registered.append((key, serial, tokens_of(), then))
        self.on_drop.append(on_drop)
        self.holds_tokens.append(holds_tokens)

    def take_embedded(self):
        return []

    def run_background(self, job, holds_tokens=0):
        pass

    def stop_registrations(self):
        pass

    def close(self):
        pass


def test_a_captured_donor_is_announced_with_its_embedding():
    import numpy as np

    from semshare_vllm.discovery.embedder import DocumentEmbedding
    from semshare_vllm.discovery.service import Embedded

    feed, discovery = FakeFeed(), FakeDiscovery()
    config = dataclasses.replace(shared_config(), tp_semantic_reuse=True)  # (TP=2: a search)
    s = SemShareScheduler(config, geometry(tp_size=2), discovery, feed=feed)
    donor = list(range(100))
    finish(s, donor, salt="t")
    key = s.build_connector_meta(None).captures[0].key
    assert feed.published == []  # not before it is embedded
    ((reg_key, serial, tokens, then),) = discovery.registered
    assert reg_key == key and tokens == donor  # the prompt is what is embedded
    emb = DocumentEmbedding(np.ones(384, np.float32), np.ones((1, 384), np.float32), 90)
    then(Embedded(key, serial, emb, 1234, 5.0))  # on the discovery thread
    (record,) = feed.published
    assert (record.namespace, record.donor_id) == ("t", key.donor_id)
    assert record.token_ids == donor + [7] and record.num_prompt_tokens == 100
    assert record.ranks == 2 and record.embedding is emb and record.fingerprint == 1234
    assert record.embedder_id == "embedder-x"
    s.shutdown()
    assert feed.closed


def test_a_donor_whose_embedding_the_backlog_drops_is_still_announced():
    """Review: with a shared index a captured donor was published only once embedded, so one
    the discovery backlog dropped (donors arriving faster than they are embedded) was never
    announced to the other instances. It is published without an embedding (readers embed it
    themselves), and its queued work counts the tokens it keeps alive."""
    feed, discovery = FakeFeed(), FakeDiscovery()
    config = dataclasses.replace(shared_config(), tp_semantic_reuse=True)
    s = SemShareScheduler(config, geometry(tp_size=2), discovery, feed=feed)
    donor = list(range(100))
    finish(s, donor, salt="t")
    key = s.build_connector_meta(None).captures[0].key
    assert feed.published == [] and discovery.holds_tokens == [101]
    (on_drop,) = discovery.on_drop
    assert on_drop is not None
    on_drop()  # the backlog dropped it
    (record,) = feed.published
    assert (record.namespace, record.donor_id) == ("t", key.donor_id)
    assert record.token_ids == donor + [7] and record.embedding is None
    s.shutdown()


def test_without_discovery_a_donor_is_announced_at_capture():
    feed = FakeFeed()
    s = SemShareScheduler(shared_config(), geometry(), feed=feed)
    finish(s, list(range(100)))
    (record,) = feed.published
    assert record.embedding is None and record.ranks == 1


def test_shared_donors_join_their_namespace_and_loads_carry_their_tokens():
    from semshare_vllm.catalog.shared_records import SharedDonor

    tokens = list(range(500, 700))
    digests = ["ab" * 32]  # its rank's KV digest, from its signed mark
    good = SharedDonor("t", donor_id_for("t", tokens), tokens, 200, kv_digests=digests)
    forged = SharedDonor(
        "t",
        donor_id_for("other", tokens),
        tokens,
        200,  # id of another ns
        kv_digests=digests,
    )
    other = list(range(800, 900))
    undigested = SharedDonor("t", donor_id_for("t", other), other, 100)  # no KV digests
    stats = StatsRecorder()  # the connector hands the feed the scheduler's
    feed = FakeFeed([good, forged, undigested], stats)
    s = SemShareScheduler(shared_config(), geometry(), feed=feed, stats=stats)
    s.build_connector_meta(None)
    assert s.stats.totals["donors_shared_in"] == 1
    assert s.stats.totals["shared_records_dropped"] == 2
    assert s.stats.totals["shared_index_outages"] == 1
    assert s.stats.totals["shared_records_forged"] == 2
    assert s.get_num_new_matched_tokens(request("x", tokens[:150] + [1], salt="u"), 0) == (
        0,
        False,
    )  # another namespace sees nothing
    target = request("y", tokens[:150] + [1], salt="t")
    assert s.get_num_new_matched_tokens(target, 0) == (128, False)
    s.update_state_after_alloc(target, Blocks(list(range(5))), 128)
    load = s.build_connector_meta(None).loads[0]
    assert load.key == DonorKey("t", good.donor_id) and load.donor_token_ids == tokens
    assert load.donor_kv_digests == digests  # the worker checks what it fetches
    assert feed.published == []  # never announced again by this instance


def test_a_malformed_shared_record_costs_that_record_only():
    import numpy as np

    from semshare_vllm.catalog.shared_records import SharedDonor
    from semshare_vllm.discovery.embedder import DocumentEmbedding

    tokens = list(range(300, 400))
    bad = SharedDonor(
        "",
        donor_id_for("", tokens),
        tokens,
        100,
        embedder_id="embedder-x",
        embedding=DocumentEmbedding(np.ones(7, np.float32), np.ones((1, 7), np.float32), 5),
        fingerprint=1,
        kv_digests=["ab" * 32],
    )
    s = SemShareScheduler(shared_config(), geometry(), FakeDiscovery(), feed=FakeFeed([bad]))
    s.build_connector_meta(None)  # no exception reaches vLLM
    assert s.stats.totals["shared_records_dropped"] == 1


def test_a_disabled_worker_stops_claims_and_captures():
    """The worker turned itself off (a layout it cannot address): the scheduler stops claiming
    (each load would fail and be recomputed) and capturing, from the report on."""
    s = SemShareScheduler(SemShareConfig(), geometry())
    donor = list(range(200))
    finish(s, donor)
    s.build_connector_meta(None)
    s.update_connector_output(
        SimpleNamespace(finished_sending={"done"}, kv_connector_worker_meta=None)
    )
    assert s.get_num_new_matched_tokens(request("t", donor[:150] + [1]), 0) == (128, False)
    s.update_connector_output(
        SimpleNamespace(
            finished_sending=None,
            kv_connector_worker_meta=SemShareWorkerMetadata(disabled="kernel blocks of 16"),
        )
    )
    assert s.get_num_new_matched_tokens(request("u", donor[:150] + [1]), 0) == (0, False)
    assert finish(s, list(range(1000, 1100)))[0] is False
    assert s.build_connector_meta(None).captures == []


def test_exact_only_kv_plans_no_recompute_for_exact_loads():
    """Quantised KV ("exact-prefix only"): recompute_policy "all" would repair exact loads
    through a runner that ignores the KV scales; the loads stay plain page copies."""
    s = SemShareScheduler(
        SemShareConfig(recompute_policy="all"), geometry(exact_only="fp8_e4m3 KV")
    )
    donor = list(range(200))
    finish(s, donor)
    target = request("t", donor[:150] + [1])
    assert s.get_num_new_matched_tokens(target, 0) == (128, False)
    s.update_state_after_alloc(target, Blocks(list(range(10, 15))), 128)
    load = s.build_connector_meta(None).loads[0]
    assert load.policy == "none" and load.token_ids == []


def test_semantic_claims_are_refused_under_tensor_parallelism_unless_allowed(caplog):
    """Under tensor parallelism (the ranks' agreement is tested on vLLM's CPU build only) the
    scheduler runs no donor search, so it claims exact prefixes only, and says so once;
    ``tp_semantic_reuse`` lets it search. One rank: searched as ever."""
    import logging

    with caplog.at_level(logging.WARNING, logger="vllm.semshare.scheduler"):
        s = SemShareScheduler(SemShareConfig(), geometry(tp_size=2), FakeDiscovery())
    assert s.discovery is None and s.search is None
    (warning,) = [r.getMessage() for r in caplog.records if "tensor" in r.getMessage()]
    assert "exact-prefix reuse only" in warning and "tp_semantic_reuse" in warning
    donor = list(range(200))
    finish(s, donor)
    s.build_connector_meta(None)
    assert s.get_num_new_matched_tokens(request("t", donor[:150] + [1, 2, 3]), 0) == (128, False)

    allowed = SemShareConfig(tp_semantic_reuse=True)
    assert SemShareScheduler(allowed, geometry(tp_size=2), FakeDiscovery()).search is not None
    assert SemShareScheduler(SemShareConfig(), geometry(), FakeDiscovery()).search is not None


def test_a_fault_ageing_unconfirmed_loads_never_reaches_vllms_schedule(monkeypatch):
    s = SemShareScheduler(SemShareConfig(), geometry())

    def broken():
        raise RuntimeError("evict_blocks failed")

    monkeypatch.setattr(s.load_watch, "age_unconfirmed", broken)
    assert s.build_connector_meta(None).loads == []
    assert s.stats.totals["fallbacks"] == 1


def test_start_up_skips_a_file_that_vanishes_or_lies_in_its_header(tmp_path):
    """Start-up restores what it can and never stops on a file: one another instance sharing the
    directory deleted between the listing and its read (here a dangling link), one whose header
    parses but holds no token ids. Either stopped the scheduler half, and vLLM with it, on every
    restart (review)."""
    root = tmp_path / "fp"
    kv = torch.zeros(len(LAYERS), 2, 64, 2, 8)
    good = list(range(64))
    good_id = donor_id_for("ns", good)
    donor_file.write(
        donor_file.donor_path(root, good_id, 0, 1), "ns", good_id, good, list(LAYERS), "L", kv
    )
    words = donor_file.donor_path(root, "1" * 32, 0, 1)
    donor_file.write(words, "ns", "1" * 32, ["not", "token", "ids"], list(LAYERS), "L", kv)
    (root / f"{'2' * 32}.tp0of1.safetensors").symlink_to(root / "deleted.safetensors")

    s = SemShareScheduler(SemShareConfig(persist_dir=str(tmp_path)), geometry())
    assert s.stats.totals["donors_restored"] == 1
    assert s.stats.totals["persisted_skipped"] == 2
    assert s.get_num_new_matched_tokens(request("t", good + [1], salt="ns"), 0) == (64, False)


def _persisted_donor(root, tokens):
    key_id = donor_id_for("ns", tokens)
    path = donor_file.donor_path(root, key_id, 0, 1)
    kv = torch.zeros(len(LAYERS), 2, len(tokens), 2, 8)
    donor_file.write(path, "ns", key_id, tokens, list(LAYERS), "L", kv)
    return path


def test_workers_that_loaded_another_model_keep_the_engines_donors_at_home(tmp_path):
    """vLLM's start-up handshake brings each worker's fingerprint, of the identity it took as
    it loaded the model. This half computed its own later: when the model's files changed in
    between, the two differ, and the donors restored under this half's fingerprint (another
    checkpoint's) would be served over the weights the workers hold. They are forgotten
    before any request (their files stay), and nothing is persisted or shared from then on."""
    tokens = list(range(64))
    path = _persisted_donor(tmp_path / "fp", tokens)
    for reports in (
        {0: SemShareHandshake("fp"), 1: SemShareHandshake("another")},
        {0: SemShareHandshake("fp", local_only="the files changed after vLLM loaded them")},
    ):
        feed = FakeFeed()
        s = SemShareScheduler(SemShareConfig(persist_dir=str(tmp_path)), geometry(), feed=feed)
        assert s.stats.totals["donors_restored"] == 1
        s.confirm_workers(reports)
        assert s.geometry.local_only and "worker" in s.geometry.local_only
        assert s.workers_confirmed == 0 and s.snapshots is None and feed.closed
        assert s.get_num_new_matched_tokens(request("t", tokens + [1], salt="ns"), 0) == (0, False)
        assert s.build_connector_meta(None).evictions == [] and path.exists()


def test_workers_that_loaded_this_model_change_nothing(tmp_path):
    tokens = list(range(64))
    _persisted_donor(tmp_path / "fp", tokens)
    feed = FakeFeed()
    s = SemShareScheduler(SemShareConfig(persist_dir=str(tmp_path)), geometry(), feed=feed)
    s.confirm_workers({0: SemShareHandshake("fp"), 1: SemShareHandshake("fp")})
    assert s.geometry.local_only is None and s.workers_confirmed == 2 and not feed.closed
    assert s.get_num_new_matched_tokens(request("t", tokens + [1], salt="ns"), 0) == (64, False)


def test_a_fault_comparing_the_workers_turns_the_connector_off(tmp_path, monkeypatch):
    tokens = list(range(64))
    _persisted_donor(tmp_path / "fp", tokens)
    s = SemShareScheduler(SemShareConfig(persist_dir=str(tmp_path)), geometry())
    monkeypatch.setattr(s.catalog, "clear", lambda **kw: 1 / 0)
    s.confirm_workers({0: SemShareHandshake("another")})
    assert s.geometry.unsupported
    assert s.get_num_new_matched_tokens(request("t", tokens + [1], salt="ns"), 0) == (0, False)


def test_a_fault_in_the_connector_reset_never_reaches_vllm():
    """vLLM's ``reset_connector_cache`` (its pause and sleep) has no ``try``: a fault of ours in
    the reset (here the shared index's close) must turn the connector off, not fail the pause
    (the review of the handshake change: its method was inserted under the reset's guard)."""

    class RaisingFeed(FakeFeed):
        def close(self, timeout_s=None):
            raise ConnectionError("redis went away")

    s = SemShareScheduler(SemShareConfig(), geometry(), feed=RaisingFeed())
    assert s.reset_cache() is True
    assert s.geometry.unsupported
