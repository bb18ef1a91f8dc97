"""Two real `vllm serve` instances (loopback, different ports) sharing one real `redis-server`
as LMCache's remote backend and as the shared donor index: a donor served by instance A is
found and reused by instance B, in its own namespace only; a record written straight into the
stream by a client without the instances' secret is dropped (counted) and serves nothing; Redis
going away mid-run fails no request (local fallback, counted), and sharing resumes when it is
back."""

import pytest
from support.thread_cores import connector_threads_off_the_compute_core

from semshare_vllm.testbed.redis_server import RedisServer
from semshare_vllm.testbed.server import SEMSHARE, VllmServer
from semshare_vllm.testbed.text import wiki_document

pytestmark = pytest.mark.engine

Q1 = "\n\nQuestion: What is the text above about? Answer:"
Q2 = "\n\nSummarize the passage above in one sentence:"
DOCS = {
    name: wiki_document(start, 900)
    for name, start in [
        ("shared", 300),
        ("unseen", 700),
        ("outage", 1100),
        ("after", 1500),
        ("forged", 1900),
    ]
}
ARGS = ["--block-size", "32", "--max-num-seqs", "4"]
SECRET = "engine-test-secret"


@pytest.fixture(scope="module")
def cold(model, tmp_path_factory):
    """vLLM's own answers, no connector."""
    log = tmp_path_factory.mktemp("logs") / "cold.log"
    with VllmServer(model, None, ARGS, log) as srv:
        return {name: srv.complete(doc + Q2).text for name, doc in DOCS.items()}


def shared_server(model, redis_url, log):
    extra = {
        "host_store_bytes": "512MiB",
        "kv_tier": "lmcache",
        "lmcache_local_cpu_bytes": "256MiB",
        "lmcache_remote_url": redis_url,
        "shared_index_url": redis_url,
        "shared_index_secret": SECRET,
        "lookup_deadline_ms": 5000,
    }
    return VllmServer(model, dict(SEMSHARE, kv_connector_extra_config=extra), ARGS, log)


def forge_record(model, redis_url, prompt):
    """What a client of the Redis server without the secret can do: add a donor record for
    ``prompt`` (no namespace, well-formed, its id right) to the instances' stream, with a bogus
    signature, and mark its KV ready (validly, so that only the record's signature is wrong)."""
    import redis as redis_py
    from transformers import AutoTokenizer

    from semshare_vllm.catalog.shared_index import KVReadyMarks
    from semshare_vllm.catalog.shared_records import SharedDonor
    from semshare_vllm.core.keys import donor_id_for

    tokens = AutoTokenizer.from_pretrained(model)(prompt)["input_ids"]
    record = SharedDonor("", donor_id_for("", tokens), tokens, len(tokens))
    client = redis_py.Redis.from_url(redis_url)
    try:
        (stream,) = client.scan_iter(match="semshare:donors:*", _type="stream")
        fingerprint = stream.decode().rsplit(":", 1)[1]
        marks = KVReadyMarks(redis_url, fingerprint, 0, SECRET)
        marks.mark(record.donor_id, "0" * 64)
        marks.close()
        client.xadd(stream, {**record.encode("attacker"), b"sig": b"f" * 64})
    finally:
        client.close()


def test_two_instances_share_donors_through_redis(model, cold, tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_LOG_STATS_INTERVAL", "1")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # two engines on one machine
    redis = RedisServer().start()
    try:
        with (
            shared_server(model, redis.url, tmp_path / "a.log") as a,
            shared_server(model, redis.url, tmp_path / "b.log") as b,
        ):
            # A serves the donor; its KV goes to Redis, its record to the stream; B adds it.
            # Only B is kept stepping: idle, A still announces it.
            assert a.complete(DOCS["shared"] + Q1).cached_tokens == 0
            b.wait_for_stat("donors_shared_in", 1)
            hit = b.complete(DOCS["shared"] + Q2)
            assert hit.cached_tokens >= 0.8 * hit.prompt_tokens
            assert hit.text == cold["shared"]
            b.wait_for_stat("tier_fetches", 1)  # fetched from LMCache + Redis
            cores_a = a.thread_cores()  # its capture and tier threads have run

            # A forged record is dropped, counted, and never serves a request.
            forge_record(model, redis.url, DOCS["forged"] + Q1)
            b.wait_for_stat("shared_records_forged", 1)
            assert b.connector_stats()["donors_shared_in"] == 1
            forged = b.complete(DOCS["forged"] + Q2)
            assert forged.cached_tokens == 0 and forged.text == cold["forged"]

            # Namespaces stay hard boundaries across instances.
            other = b.complete(DOCS["shared"] + Q2, cache_salt="another-tenant")
            assert other.cached_tokens == 0 and other.text == cold["shared"]

            # A donor B has never loaded, then Redis goes away.
            a.complete(DOCS["unseen"] + Q1)
            b.wait_for_stat("donors_shared_in", 2)
            redis.stop()
            lost = b.complete(DOCS["unseen"] + Q2)  # its KV is unreachable: computed
            assert lost.text == cold["unseen"]
            b.wait_for_stat("load_failures", 1)
            kept = b.complete(DOCS["shared"] + Q2)  # already in B's host store: still a hit
            assert kept.cached_tokens >= 0.8 * kept.prompt_tokens
            assert kept.text == cold["shared"]
            a.complete(DOCS["outage"] + Q1)  # captured locally; not shared
            alone = b.complete(DOCS["outage"] + Q2)
            assert alone.cached_tokens == 0 and alone.text == cold["outage"]
            a.wait_for_stat("tier_put_failures", 1)
            for srv in (a, b):
                assert "shared donor index at " + redis.url + " is unreachable" in srv.log_text()

            # Redis is back (empty): sharing resumes for new donors.
            redis.start()
            a.complete(DOCS["after"] + Q1)
            b.wait_for_stat("donors_shared_in", 3)
            back = b.complete(DOCS["after"] + Q2)
            assert back.cached_tokens >= 0.8 * back.prompt_tokens
            assert back.text == cold["after"]
            b.wait_for_stat("tier_fetches", 2)  # its stats line may still be due
            stats_a, stats_b = a.connector_stats(), b.connector_stats()
            logs = a.log_text() + b.log_text()
    finally:
        redis.stop()
    assert "fallbacks" not in stats_a and "fallbacks" not in stats_b
    assert stats_b["tier_fetches"] == 2 and "tier_fetches" not in stats_a
    assert "tier_digest_mismatches" not in stats_b  # the real donors' KV matched its digests
    assert logs.count("is back") == 2 and "Traceback" not in logs
    # off the forward pass's core: the capture's copy, the tier's digest and put, and LMCache's
    # own event loop, stats logger and pin monitor (started from the tier's thread; the load's
    # thread starts with A's first load, which it may not have had)
    connector_threads_off_the_compute_core(cores_a, worker_threads=5)
