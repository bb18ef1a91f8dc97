"""The contract every donor KV store keeps (``store.base.DonorKVStore``): the built-in host store
and LMCache (local CPU, and with a real Redis server as its remote backend) pass the same tests.
The Redis cases also check what the stores promise across instances: a second LMCache engine
(another vLLM instance's) reads what the first wrote, and an outage costs misses, not errors."""

import pytest
import torch

from semshare_vllm.core.keys import DonorKey
from semshare_vllm.layout.specs import page_spec
from semshare_vllm.store.host_store import HostKVStore

L, H, D, BS = 3, 2, 32, 32
CHUNK = 16  # LMCache's chunk size here (256 in service): several chunks per donor


def rows(n, seed=0):
    return torch.randn(L, n, H, 2 * D, generator=torch.Generator().manual_seed(seed))


def tokens(n, seed=0):
    return torch.randint(0, 50000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def host_store():
    return HostKVStore(
        64 * L * H * BS * 2 * D * 4,
        [f"l{i}" for i in range(L)],
        (H, BS, 2 * D),
        torch.float32,
        page_layout=page_spec("CPU_ATTN", D, "vec"),
    )


def lmcache_store(remote_url=None):
    from semshare_vllm.store.lmcache_store import LMCacheKVStore

    return LMCacheKVStore(
        L,
        H,
        D,
        torch.float32,
        "contract-model",
        32 * 2**20,
        remote_url=remote_url,
        chunk_size=CHUNK,
    )


@pytest.fixture(scope="module")
def redis():
    from semshare_vllm.testbed.redis_server import RedisServer

    with RedisServer() as server:
        yield server


@pytest.fixture(params=["host", "lmcache", "lmcache+redis"])
def store(request):
    if request.param == "host":
        s = host_store()
    else:
        s = lmcache_store(
            request.getfixturevalue("redis").url if request.param.endswith("redis") else None
        )
    yield s
    s.close()


def drop(store, key) -> bool:
    """Forget the donor where the store can be told to (the host store; LMCache evicts by its
    own policy): whether it was."""
    if store.name != "host":
        return False
    store.drop(key)
    return True


def test_a_donor_comes_back_whole_and_by_range(store):
    key, toks, kv = DonorKey("", "d1"), tokens(53), rows(53)
    assert store.get(key, toks) is None
    store.put(key, toks, kv)
    assert torch.equal(store.get(key, toks), kv)  # bit-exact
    for start, end in [(0, 16), (5, 40), (16, 32), (47, 53)]:  # inside and across chunks
        assert torch.equal(store.get(key, toks, start, end), kv[:, start:end])


def test_evicted_unknown_and_other_donors(store):
    a, b = DonorKey("", "a"), DonorKey("", "b")
    ta, tb = tokens(40, 1), tokens(20, 2)
    store.put(a, ta, rows(40, 1))
    store.put(b, tb, rows(20, 2))
    if drop(store, a):
        assert store.get(a, ta) is None
    assert torch.equal(store.get(b, tb), rows(20, 2))
    assert store.get(DonorKey("", "never"), tokens(30, 3)) is None
    drop(store, DonorKey("", "never"))  # no error


def test_namespaces_never_share_a_donor(store):
    toks = tokens(48, 4)
    store.put(DonorKey("tenant-a", "x"), toks, rows(48, 5))
    store.put(DonorKey("tenant-b", "x2"), toks, rows(48, 6))
    assert torch.equal(store.get(DonorKey("tenant-a", "x"), toks), rows(48, 5))
    assert torch.equal(store.get(DonorKey("tenant-b", "x2"), toks), rows(48, 6))
    assert store.get(DonorKey("tenant-c", "x"), toks) is None


def test_namespace_tags_are_one_to_one(store):
    """No namespace ("") and the namespace "-" (or any two) never share LMCache keys: each reads
    its own rows, and evicting one leaves the other whole."""
    toks = tokens(48, 12)
    empty, dash = DonorKey("", "e"), DonorKey("-", "d")
    store.put(empty, toks, rows(48, 13))
    store.put(dash, toks, rows(48, 14))
    assert torch.equal(store.get(empty, toks), rows(48, 13))
    assert torch.equal(store.get(dash, toks), rows(48, 14))
    if drop(store, dash):
        assert store.get(dash, toks) is None
    assert torch.equal(store.get(empty, toks), rows(48, 13))
    odd = DonorKey("a b|c:d\n\u00e9", "o")  # safe inside LMCache's key strings
    store.put(odd, toks, rows(48, 15))
    assert torch.equal(store.get(odd, toks), rows(48, 15))


def test_a_fetched_donor_has_the_digest_its_writer_signed(redis):
    """What a worker checks a shared donor's KV against (``catalog.shared_records.kv_digest``): the
    digest of the rows it put, in the store's dtype, equals that of the rows another instance
    fetches."""
    from semshare_vllm.catalog.shared_records import kv_digest
    from semshare_vllm.store.lmcache_store import LMCacheKVStore

    def half_store():
        return LMCacheKVStore(
            L,
            H,
            D,
            torch.float16,
            "digest-model",
            32 * 2**20,
            remote_url=redis.url,
            chunk_size=CHUNK,
        )

    first, second = half_store(), half_store()
    try:
        key, toks, kv = DonorKey("t", "digest"), tokens(70, 16), rows(70, 16)  # float32 rows
        assert first.put(key, toks, kv)
        fetched = second.get(key, toks)
        assert kv_digest(fetched, second.dtype) == kv_digest(kv, first.dtype)
        assert kv_digest(fetched, second.dtype) != kv_digest(kv)
    finally:
        first.close()
        second.close()


def test_a_second_instance_reads_the_donor_from_redis(redis):
    first, second = lmcache_store(redis.url), lmcache_store(redis.url)
    try:
        key, toks, kv = DonorKey("", "shared"), tokens(70, 7), rows(70, 7)
        first.put(key, toks, kv)
        assert first.visible(key, toks)
        assert torch.equal(second.get(key, toks), kv)
        assert torch.equal(second.get(key, toks, 20, 50), kv[:, 20:50])
    finally:
        first.close()
        second.close()


def test_a_redis_outage_costs_misses_not_errors():
    from semshare_vllm.testbed.redis_server import RedisServer

    server = RedisServer().start()
    writer, reader = lmcache_store(server.url), lmcache_store(server.url)
    try:
        key, toks = DonorKey("", "outage"), tokens(40, 8)
        server.stop()
        writer.put(key, toks, rows(40, 8))  # no error
        assert reader.get(key, toks) is None
        server.start()  # back: reuse resumes
        writer.put(key, toks, rows(40, 9))
        assert writer.visible(key, toks)
        assert torch.equal(reader.get(key, toks), rows(40, 9))
    finally:
        writer.close()
        reader.close()
        server.stop()


def test_the_first_put_after_a_redis_restart_is_readable():
    """LMCache's first put after the server restarts goes to the connection it closed and is
    lost; ``put`` notices (not readable in time) and puts once more."""
    from semshare_vllm.testbed.redis_server import RedisServer

    server = RedisServer().start()
    writer, reader = lmcache_store(server.url), lmcache_store(server.url)
    writer.put_timeout_s = 5.0  # not tight: a loaded machine takes longer to make it readable
    try:
        assert writer.put(DonorKey("", "before"), tokens(40, 10), rows(40, 10))
        server.stop()
        server.start()
        key, toks = DonorKey("", "after-restart"), tokens(40, 11)
        assert writer.put(key, toks, rows(40, 11))
        assert torch.equal(reader.get(key, toks), rows(40, 11))
    finally:
        writer.close()
        reader.close()
        server.stop()


def test_lmcache_leaves_no_prometheus_directory_to_the_processes_started_after():
    """Importing the LMCache store set PROMETHEUS_MULTIPROC_DIR for the rest of the process (so
    that LMCache's files went to a private directory, not its fixed one in /tmp): every process
    started from it afterwards, a `vllm serve` or vLLM's own workers, inherited the directory,
    and prometheus_client then summed every such process's counters into each one's /metrics
    (seen in this suite: a server reported the semantic hits of two servers before it). The
    directory is set only while LMCache is imported and builds an engine."""
    import subprocess
    import sys

    script = """
import os
os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
import semshare_vllm.store.lmcache_store as m
assert "PROMETHEUS_MULTIPROC_DIR" not in os.environ, "after import"
import torch
s = m.LMCacheKVStore(3, 2, 32, torch.float32, "m", 1 << 25, chunk_size=16)
assert "PROMETHEUS_MULTIPROC_DIR" not in os.environ, "after build"
import prometheus_client
prometheus_client.Counter("made_after", "a metric this process creates later")
s.close()
print("ok")
"""
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
