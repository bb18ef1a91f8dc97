"""The shared donor index (``shared_index.SharedDonorFeed``) on a real ``redis-server``: records
cross instances intact once every rank's KV is marked readable (not before), an instance never
reads its own, a late instance catches up, an outage is counted and survived, and reading
resumes when Redis is back."""

import time

import numpy as np
import pytest

from semshare_vllm.discovery.embedder import DocumentEmbedding
from semshare_vllm.shared_index import KVReadyMarks, SharedDonor, SharedDonorFeed
from semshare_vllm.testbed.redis_server import RedisServer


def donor(i, ns="", with_embedding=True):
    rng = np.random.default_rng(i)
    emb = None
    if with_embedding:
        vec = rng.standard_normal(384).astype(np.float32)
        emb = DocumentEmbedding(vec / np.linalg.norm(vec),
                                rng.standard_normal((3, 384)).astype(np.float32), 700)
    return SharedDonor(ns, f"donor-{i}", rng.integers(0, 49152, 300 + i).tolist(), 250,
                       embedding=emb, embedder_id="minilm-x",
                       fingerprint=int(rng.integers(0, 2**63)) if with_embedding else None)


def publish_ready(feed, record, ranks=(0,)):
    """Publish ``record`` and mark its KV readable, as the workers of its instance would."""
    for rank in ranks:
        marks = KVReadyMarks(feed.url, feed.fingerprint, rank)
        assert marks.mark(record.donor_id)
        marks.close()
    feed.publish(record)


def arrivals(feed, n, timeout_s=10.0):
    out, deadline = [], time.monotonic() + timeout_s
    while len(out) < n and time.monotonic() < deadline:
        out += feed.take_arrived()
        time.sleep(0.02)
    return out


@pytest.fixture
def redis():
    with RedisServer() as server:
        yield server


def test_records_cross_instances_intact_and_never_come_back_to_their_sender(redis):
    a, b = SharedDonorFeed(redis.url, "fp"), SharedDonorFeed(redis.url, "fp")
    try:
        sent = [donor(1), donor(2, ns="tenant-b", with_embedding=False)]
        for record in sent:
            publish_ready(a, record)
        got = arrivals(b, 2)
        assert [r.donor_id for r in got] == ["donor-1", "donor-2"]
        first, second = got
        assert first.token_ids == sent[0].token_ids and first.num_prompt_tokens == 250
        assert first.namespace == "" and second.namespace == "tenant-b"
        assert np.array_equal(first.embedding.vector, sent[0].embedding.vector)
        assert np.array_equal(first.embedding.segments, sent[0].embedding.segments)
        assert first.embedding.num_tokens == 700 and first.fingerprint == sent[0].fingerprint
        assert first.embedder_id == "minilm-x"
        assert second.embedding is None and second.fingerprint is None
        time.sleep(0.3)
        assert a.take_arrived() == []                     # its own records are skipped
        assert a.take_counts().get("published") == 2
        assert b.take_counts().get("received") == 2
    finally:
        a.close()
        b.close()


def test_a_late_instance_catches_up_and_other_models_stay_apart(redis):
    a = SharedDonorFeed(redis.url, "fp")
    other_model = SharedDonorFeed(redis.url, "another-fingerprint")
    try:
        for i in range(5):
            publish_ready(a, donor(i))
        late = SharedDonorFeed(redis.url, "fp")
        try:
            assert sorted(r.donor_id for r in arrivals(late, 5)) == \
                [f"donor-{i}" for i in range(5)]
        finally:
            late.close()
        time.sleep(0.3)
        assert other_model.take_arrived() == []
    finally:
        a.close()
        other_model.close()


def test_an_outage_is_counted_and_reading_resumes_when_redis_is_back():
    server = RedisServer().start()
    a, b = SharedDonorFeed(server.url, "fp"), SharedDonorFeed(server.url, "fp")
    try:
        publish_ready(a, donor(1))
        assert len(arrivals(b, 1)) == 1
        server.stop()
        a.publish(donor(2))                               # lost, counted; nothing raises
        deadline = time.monotonic() + 10
        while (a.connected or b.connected) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not a.connected and not b.connected
        server.start()                                    # same port, empty (no persistence)
        deadline = time.monotonic() + 20
        while not (a.connected and b.connected) and time.monotonic() < deadline:
            time.sleep(0.05)
        publish_ready(a, donor(3))
        # donor-2 went out after the restart, or was lost to the outage (counted): either way
        # donor-3 arrives, and nothing twice
        got = [r.donor_id for r in arrivals(b, 2, timeout_s=5)]
        assert "donor-3" in got and len(set(got)) == len(got) and "donor-1" not in got
        counts_a, counts_b = a.take_counts(), b.take_counts()
        assert counts_a.get("outages") == 1 and counts_b.get("outages") == 1
        assert counts_a.get("publish_failures", 0) + counts_a.get("published", 0) == 3
    finally:
        a.close()
        b.close()
        server.stop()


def test_an_unreadable_record_is_dropped_and_counted(redis):
    import redis as redis_py

    feed = SharedDonorFeed(redis.url, "fp")
    try:
        client = redis_py.Redis.from_url(redis.url)
        client.xadd(feed.stream, {b"v": b"99", b"instance": b"future"})
        client.xadd(feed.stream, {b"v": b"1", b"instance": b"x"})         # fields missing
        feed_b = SharedDonorFeed(redis.url, "fp")
        try:
            publish_ready(feed_b, donor(4))
            assert [r.donor_id for r in arrivals(feed, 1)] == ["donor-4"]
            assert feed.take_counts().get("dropped") == 2
        finally:
            feed_b.close()
        client.close()
    finally:
        feed.close()


def test_a_record_waits_for_every_rank_and_is_dropped_if_its_kv_never_comes(redis):
    a = SharedDonorFeed(redis.url, "fp")
    b = SharedDonorFeed(redis.url, "fp", ready_wait_s=1.0)
    try:
        two_ranks = donor(5)
        two_ranks.ranks = 2
        publish_ready(a, two_ranks, ranks=(0,))        # rank 1's put is still in flight
        a.publish(donor(6))                            # its KV never becomes readable
        assert arrivals(b, 1, timeout_s=0.5) == []
        marks = KVReadyMarks(redis.url, "fp", 1)
        marks.mark("donor-5")
        marks.close()
        assert [r.donor_id for r in arrivals(b, 1)] == ["donor-5"]
        time.sleep(1.5)
        assert b.take_arrived() == [] and b.take_counts().get("unready") == 1
    finally:
        a.close()
        b.close()
