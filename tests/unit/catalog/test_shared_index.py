"""The shared donor index (``catalog.shared_index.SharedDonorFeed``) on a real ``redis-server``:
records cross instances intact once every rank's KV is marked readable (not before), an instance
never reads its own, a late instance catches up, an outage is counted and survived, and reading
resumes when Redis is back. Only what is signed with the instances' secret counts: forged
records and readiness marks are dropped, records that do not fit this engine are dropped without
holding up the feed, and a worker refuses KV whose digest is not the one its rank signed."""

import time

import numpy as np
import pytest
import torch

from semshare_vllm.catalog.shared_index import KVReadyMarks, SharedDonorFeed, ready_key
from semshare_vllm.catalog.shared_records import FORMAT, SharedDonor, kv_digest, sign_record
from semshare_vllm.core.counters import StatsRecorder
from semshare_vllm.discovery.embedder import DocumentEmbedding
from semshare_vllm.testbed.redis_server import RedisServer

SECRET = "test-secret"


def Feed(url, fingerprint="fp", **kw):
    """A feed counting into a recorder of its own (``feed.stats``), as the scheduler's."""
    return SharedDonorFeed(
        url, fingerprint, secret=kw.pop("secret", SECRET), stats=StatsRecorder(), **kw
    )


def counts(feed):
    return feed.stats.totals


def shard_digest(donor_id, rank):
    """A stand-in for the digest of rank ``rank``'s KV shard of ``donor_id``."""
    return kv_digest(torch.tensor([hash((donor_id, rank)) % 1000], dtype=torch.float32))


def did(i):
    """Donor ids are 32 hex digits (``core.keys.donor_id_for``)."""
    return f"{i:032x}"


def donor(i, ns="", with_embedding=True):
    rng = np.random.default_rng(i)
    emb = None
    if with_embedding:
        vec = rng.standard_normal(384).astype(np.float32)
        emb = DocumentEmbedding(
            vec / np.linalg.norm(vec), rng.standard_normal((3, 384)).astype(np.float32), 700
        )
    return SharedDonor(
        ns,
        did(i),
        rng.integers(0, 49152, 300 + i).tolist(),
        250,
        embedding=emb,
        embedder_id="minilm-x",
        fingerprint=int(rng.integers(0, 2**63)) if with_embedding else None,
    )


def publish_ready(feed, record, ranks=(0,)):
    """Publish ``record`` and mark its KV readable, as the workers of its instance would."""
    for rank in ranks:
        marks = KVReadyMarks(feed.url, feed.fingerprint, rank, SECRET)
        assert marks.mark(record.donor_id, shard_digest(record.donor_id, rank))
        marks.close()
    feed.publish(record)


def arrivals(feed, n, timeout_s=10.0):
    out, deadline = [], time.monotonic() + timeout_s
    while len(out) < n and time.monotonic() < deadline:
        out += feed.take_arrived()
        time.sleep(0.02)
    return out


def until(condition, timeout_s=30.0):
    """Poll ``condition`` until true; a loaded machine may be slow, never the other way."""
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


@pytest.fixture
def redis():
    with RedisServer() as server:
        yield server


def test_records_cross_instances_intact_and_never_come_back_to_their_sender(redis):
    a, b = Feed(redis.url), Feed(redis.url)
    try:
        sent = [donor(1), donor(2, ns="tenant-b", with_embedding=False)]
        for record in sent:
            publish_ready(a, record)
        got = arrivals(b, 2)
        assert [r.donor_id for r in got] == [did(1), did(2)]
        first, second = got
        assert first.token_ids == sent[0].token_ids and first.num_prompt_tokens == 250
        assert first.namespace == "" and second.namespace == "tenant-b"
        assert np.array_equal(first.embedding.vector, sent[0].embedding.vector)
        assert np.array_equal(first.embedding.segments, sent[0].embedding.segments)
        assert first.embedding.num_tokens == 700 and first.fingerprint == sent[0].fingerprint
        assert first.embedder_id == "minilm-x"
        assert second.embedding is None and second.fingerprint is None
        # the per-rank digests of the KV, from the signed readiness marks
        assert first.kv_digests == [shard_digest(did(1), 0)]
        time.sleep(0.3)
        assert a.take_arrived() == []  # its own records are skipped
        assert counts(a)["donors_published"] == 2
    finally:
        a.close()
        b.close()


def test_a_late_instance_catches_up_and_other_models_stay_apart(redis):
    a = Feed(redis.url)
    other_model = Feed(redis.url, "another-fingerprint")
    try:
        for i in range(5):
            publish_ready(a, donor(i))
        late = Feed(redis.url)
        try:
            assert sorted(r.donor_id for r in arrivals(late, 5)) == [did(i) for i in range(5)]
        finally:
            late.close()
        time.sleep(0.3)
        assert other_model.take_arrived() == []
    finally:
        a.close()
        other_model.close()


def test_an_outage_is_counted_and_reading_resumes_when_redis_is_back():
    server = RedisServer().start()
    a, b = Feed(server.url), Feed(server.url)
    try:
        publish_ready(a, donor(1))
        assert len(arrivals(b, 1)) == 1
        server.stop()
        a.publish(donor(2))  # lost, counted; nothing raises
        deadline = time.monotonic() + 10
        while (a.connected or b.connected) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not a.connected and not b.connected
        server.start()  # same port, empty (no persistence)
        deadline = time.monotonic() + 20
        while not (a.connected and b.connected) and time.monotonic() < deadline:
            time.sleep(0.05)
        publish_ready(a, donor(3))
        # donor-2 went out after the restart, or was lost to the outage (counted): either way
        # donor-3 arrives, and nothing twice
        got = [r.donor_id for r in arrivals(b, 2, timeout_s=5)]
        assert did(3) in got and len(set(got)) == len(got) and did(1) not in got
        counts_a, counts_b = counts(a), counts(b)
        assert counts_a["shared_index_outages"] == 1 and counts_b["shared_index_outages"] == 1
        assert counts_a["shared_publish_failures"] + counts_a["donors_published"] == 3
    finally:
        a.close()
        b.close()
        server.stop()


def test_an_unreadable_record_is_dropped_and_counted(redis):
    import redis as redis_py

    feed = Feed(redis.url)
    try:
        client = redis_py.Redis.from_url(redis.url)
        client.xadd(feed.stream, {b"v": b"99", b"instance": b"future"})
        client.xadd(
            feed.stream, sign_record({b"v": FORMAT, b"instance": b"x"}, "fp", SECRET)
        )  # fields missing
        feed_b = Feed(redis.url)
        try:
            publish_ready(feed_b, donor(4))
            assert [r.donor_id for r in arrivals(feed, 1)] == [did(4)]
            assert counts(feed)["shared_records_dropped"] == 2
        finally:
            feed_b.close()
        client.close()
    finally:
        feed.close()


def test_a_record_waits_for_every_rank_and_is_dropped_if_its_kv_never_comes(redis):
    a = Feed(redis.url)
    b = Feed(redis.url, ready_wait_s=3.0, tp_size=2)
    try:
        two_ranks = donor(5)
        two_ranks.ranks = 2
        publish_ready(a, two_ranks, ranks=(0,))  # rank 1's put is still in flight
        never = donor(6)
        never.ranks = 2
        a.publish(never)  # its KV never becomes readable
        assert arrivals(b, 1, timeout_s=0.5) == []
        marks = KVReadyMarks(redis.url, "fp", 1, SECRET)
        marks.mark(did(5), shard_digest(did(5), 1))
        marks.close()
        (got,) = arrivals(b, 1)
        assert got.donor_id == did(5)
        assert got.kv_digests == [shard_digest(did(5), 0), shard_digest(did(5), 1)]
        assert until(lambda: counts(b).get("shared_records_unready") == 1)
        assert b.take_arrived() == []
    finally:
        a.close()
        b.close()


# ---- trust: signatures, validation, KV digests ---------------------------------------------
@pytest.fixture
def client(redis):
    import redis as redis_py

    c = redis_py.Redis.from_url(redis.url)
    yield c
    c.close()


def mark_ready(url, record, ranks=(0,), secret=SECRET):
    for rank in ranks:
        marks = KVReadyMarks(url, "fp", rank, secret)
        assert marks.mark(record.donor_id, shard_digest(record.donor_id, rank))
        marks.close()


def test_forged_records_are_dropped_counted_and_never_arrive(redis, client):
    """A client of the Redis server without the secret cannot announce a donor: unsigned, wrongly
    signed, signed with another secret, or altered after signing (any field)."""
    feed = Feed(redis.url)
    try:
        forged = [donor(10 + i) for i in range(6)]
        for record in forged:
            mark_ready(redis.url, record)  # even with its KV marked ready (signed)
        fields = [record.encode("attacker") for record in forged]
        client.xadd(feed.stream, fields[0])  # unsigned
        client.xadd(feed.stream, {**fields[1], b"sig": b"00" * 32})  # wrong signature
        client.xadd(feed.stream, sign_record(fields[2], "fp", "another-secret"))
        client.xadd(feed.stream, sign_record(fields[3], "another-fp", SECRET))  # other stream's
        altered = sign_record(fields[4], "fp", SECRET)
        altered[b"ns"] = b"tenant-x"  # after signing
        client.xadd(feed.stream, altered)
        altered = sign_record(fields[5], "fp", SECRET)
        altered[b"extra"] = b"1"  # a field added
        client.xadd(feed.stream, altered)
        good = donor(20)
        mark_ready(redis.url, good)
        client.xadd(feed.stream, sign_record(good.encode("honest"), "fp", SECRET))
        assert [r.donor_id for r in arrivals(feed, 1)] == [did(20)]
        time.sleep(0.3)
        assert feed.take_arrived() == []
        assert counts(feed)["shared_records_forged"] == 6
    finally:
        feed.close()


def test_a_readiness_mark_without_the_secret_never_releases_a_record(redis, client):
    a, b = Feed(redis.url), Feed(redis.url, ready_wait_s=1.0)
    try:
        plain, other_secret, other_donor = donor(30), donor(31), donor(32)
        client.set(ready_key("fp", plain.donor_id, 0), b"1")  # the old, bare mark
        mark_ready(redis.url, other_secret, secret="another-secret")
        # a valid mark of another donor, copied to this one's key
        mark_ready(redis.url, donor(33))
        client.set(
            ready_key("fp", other_donor.donor_id, 0), client.get(ready_key("fp", did(33), 0))
        )
        for record in (plain, other_secret, other_donor):
            a.publish(record)
        assert until(lambda: counts(b).get("shared_records_unready") == 3)
        assert b.take_arrived() == []
        assert counts(b)["shared_records_forged"] == 3
        mark_ready(redis.url, plain)  # its real mark comes too late
        time.sleep(0.3)
        assert b.take_arrived() == []
    finally:
        a.close()
        b.close()


def test_records_that_do_not_fit_this_engine_are_dropped_and_the_feed_goes_on(redis, client):
    """Validated on arrival, signed or not: a bad record is dropped and counted, never stalls the
    feed (ranks=10**9 would once have built a billion-key EXISTS), and the next good record is
    delivered."""
    feed = Feed(redis.url, tp_size=2, max_tokens=4096)

    def with_fields(i, **changes):
        fields = donor(i).encode("other")
        fields[b"ranks"] = b"2"
        fields.update({k.encode(): v for k, v in changes.items()})
        return fields

    rows, dim = 3, 384
    bad = [
        with_fields(40, ranks=str(10**9).encode()),
        with_fields(41, ranks=b"1"),  # another TP size
        with_fields(42, prompt=b"0"),
        with_fields(43, prompt=b"100000"),  # beyond its tokens
        with_fields(44, prompt=b"-5"),
        with_fields(45, prompt=b"1e3"),
        with_fields(46, tokens=b""),  # no tokens
        with_fields(47, tokens=b"\x01\x02\x03"),  # not int32s
        with_fields(48, tokens=np.arange(5000, dtype="<i4").tobytes()),  # over max_tokens
        with_fields(49, tokens=np.array([5, -1, 7], dtype="<i4").tobytes(), prompt=b"2"),
        with_fields(50, vec=np.ones(100, dtype="<f4").tobytes()),  # not the segments' width
        with_fields(51, seg_rows=b"0", seg=b""),
        with_fields(52, seg_rows=b"7"),  # not its segments
        with_fields(53, vec=np.full(dim, np.nan, dtype="<f4").tobytes()),
        with_fields(54, seg=np.full((rows, dim), np.inf, dtype="<f4").tobytes()),
        with_fields(55, simhash=str(2**64).encode()),
        with_fields(56, simhash=b"-1"),
        with_fields(57, enc_tokens=b"many"),
        with_fields(58, ns=b"\xff\xfe"),  # not UTF-8
        with_fields(59, id=b"../../etc"),  # not a donor id
        with_fields(60, embedder=b"\xc3"),
        {k: v for k, v in with_fields(61).items() if k != b"seg_rows"},  # half an embedding
        {b"v": FORMAT, b"\x00garbage": b"\xff" * 64},
    ]
    try:
        t0 = time.monotonic()
        for fields in bad:
            client.xadd(feed.stream, sign_record(fields, "fp", SECRET))
        good = donor(70)
        good.ranks = 2
        mark_ready(redis.url, good, ranks=(0, 1))
        client.xadd(feed.stream, sign_record(good.encode("other"), "fp", SECRET))
        got = arrivals(feed, 1, timeout_s=30.0)
        # (no bad record stalls the feed: 23 of them take well under a second)
        assert [r.donor_id for r in got] == [did(70)] and time.monotonic() - t0 < 15.0
        time.sleep(0.3)
        assert feed.take_arrived() == []
        assert counts(feed)["shared_records_dropped"] == len(bad)
    finally:
        feed.close()


def test_kv_digest_is_of_the_rows_as_stored():
    rows = torch.randn(2, 5, 2, 8, generator=torch.Generator().manual_seed(0))
    assert kv_digest(rows) == kv_digest(rows.clone())
    assert kv_digest(rows.half(), torch.float16) == kv_digest(rows, torch.float16)
    changed = rows.clone()
    changed[1, 4, 1, 7] += 1e-3
    assert kv_digest(changed) != kv_digest(rows)
    assert kv_digest(rows[:, :4]) != kv_digest(rows)
    assert kv_digest(rows.reshape(2, 5, 1, 16)) != kv_digest(rows)  # shape is part of it


def test_a_kv_digest_mismatch_fails_the_workers_fetch(monkeypatch):
    """The worker fetches another instance's donor from LMCache only if the rows are the ones
    that instance's rank signed: otherwise the donor is unavailable (the load is reported failed
    and vLLM computes it), counted as tier_digest_mismatches."""
    from semshare_vllm.core.counters import StatsRecorder
    from semshare_vllm.core.keys import DonorKey
    from semshare_vllm.metadata import LoadSpec
    from semshare_vllm.store.host_store import DonorUnavailable
    from semshare_vllm.worker.tier import Tier

    rows = torch.randn(2, 40, 2, 8, generator=torch.Generator().manual_seed(1))
    tampered = rows.clone()
    tampered[0, 0, 0, 0] = 0.0

    class Store:
        def __init__(self):
            self.held = None

        def blocks(self, key):
            if self.held is None:
                raise DonorUnavailable("not here")
            return [3, 4]

        def put(self, key, tokens, fetched):
            self.held = fetched
            return True

    class LMCache:
        dtype = torch.float32

        def __init__(self, fetched):
            self.fetched = fetched

        def get(self, key, tokens):
            return self.fetched

    expected = ["0" * 64, kv_digest(rows)]  # this worker is rank 1

    def fetch(fetched, digests):
        tier, host = Tier(lambda: LMCache(fetched), StatsRecorder(), rank=1), Store()
        tier._thread.shutdown()  # (fetches run on the caller's thread; no put here)
        tier.digests = {DonorKey("", did(1)): kv_digest(rows)}
        spec = LoadSpec(
            "r",
            DonorKey("", did(1)),
            0,
            0,
            32,
            [0],
            donor_token_ids=list(range(40)),
            donor_kv_digests=digests,
        )
        try:
            return tier.fetch(spec, host), tier, host
        except DonorUnavailable:
            return None, tier, host

    blocks, tier, host = fetch(rows, expected)
    assert blocks == [3, 4] and tier.stats.totals["tier_fetches"] == 1
    for fetched, digests in [
        (tampered, expected),  # other KV under the donor's keys
        (rows, expected[::-1]),  # another rank's digest
        (rows, expected[:1]),
    ]:  # no digest for this rank
        blocks, tier, host = fetch(fetched, digests)
        assert blocks is None and host.held is None  # never enters the host store
        assert tier.stats.totals["tier_digest_mismatches"] == 1
        assert tier.stats.totals["tier_fetches"] == 0
    # this instance's own donor, fetched back: checked against the digest this rank recorded
    blocks, tier, host = fetch(rows, None)
    assert blocks == [3, 4]
    blocks, tier, host = fetch(tampered, None)
    assert blocks is None and tier.stats.totals["tier_digest_mismatches"] == 1
    blocks, tier, host = fetch(rows, None)
    tier.digests.clear()  # nothing recorded: not used either
    assert blocks == [3, 4]
    try:
        tier.fetch(
            LoadSpec("r", DonorKey("", did(1)), 0, 0, 32, [0], donor_token_ids=list(range(40))),
            Store(),
        )
        raise AssertionError("a donor with no digest to compare with was used")
    except DonorUnavailable:
        pass
