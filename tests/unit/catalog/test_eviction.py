"""Eviction policies, and the catalog keeping its vector index in step with the KV it holds."""

import numpy as np

from semshare_vllm.catalog.donor_index import DonorIndex, DonorRecord
from semshare_vllm.catalog.eviction import MIN_DEVIATION_REPORTS, make_policy
from semshare_vllm.core.keys import DonorKey, block_hashes, donor_id_for
from semshare_vllm.discovery.embedder import DocumentEmbedding
from semshare_vllm.discovery.vector_index import VectorIndex

BS = 4


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def record(i, ns="", nbytes=100):
    tokens = [i] * 8
    return DonorRecord(
        DonorKey(ns, donor_id_for(ns, tokens)), tokens, nbytes, block_hashes(tokens, BS)
    )


def embedding(seed):
    v = np.random.default_rng(seed).standard_normal(384).astype(np.float32)
    v /= np.linalg.norm(v)
    return DocumentEmbedding(v, v[None, :], 10)


def catalog(policy="lru", capacity=300, **kw):
    clock = Clock()
    vectors = VectorIndex(kind="exact")
    idx = DonorIndex(BS, capacity, make_policy(policy, clock=clock, **kw), vectors, clock)
    return idx, vectors, clock


def add_embedded(idx, r, seed):
    idx.add(r)
    assert idx.set_embedding(r.key, r.serial, embedding(seed), seed)


def test_lru_and_the_vector_index_evict_together():
    idx, vectors, _ = catalog("lru")
    recs = [record(i) for i in range(4)]
    for i, r in enumerate(recs[:3]):
        add_embedded(idx, r, i)
    idx.touch(recs[0].key)
    evicted = idx.add(recs[3])
    assert evicted == [recs[1].key]
    assert ("", recs[1].key) not in vectors and vectors.size("") == 2
    # every searchable donor is in the catalog, and every embedded donor is searchable
    assert {c.key for c in vectors.search("", embedding(0).vector, 10)} == {
        r.key for r in idx.records() if r.embedding is not None
    }


def test_a_late_embedding_for_an_evicted_donor_is_dropped():
    idx, vectors, _ = catalog("lru", capacity=100)
    a, b = record(1), record(2)
    idx.add(a)
    serial = a.serial
    idx.add(b)  # evicts a before its embedding arrived
    assert not idx.set_embedding(a.key, serial, embedding(1), 1)
    idx.add(a)  # the same donor captured again: a new serial
    assert not idx.set_embedding(a.key, serial, embedding(1), 1)
    assert idx.set_embedding(a.key, a.serial, embedding(1), 1)
    assert vectors.size("") == 1


def test_staleness_decay_prefers_fresh_donors_over_old_popular_ones():
    idx, _, clock = catalog("decay", half_life_s=60.0)
    old, mid, new = record(1), record(2), record(3)
    idx.add(old)
    old.hits = 4  # useful long ago
    clock.now += 600  # ten half-lives idle: worth (1+4)/1024
    idx.add(mid)
    mid.hits = 1
    idx.touch(old.key)  # LRU would now evict mid ...
    old.last_used = clock.now - 600  # ... but old's last real use is long past
    idx.add(new)
    assert idx.add(record(4)) == [old.key]


def test_decay_keeps_the_more_used_of_equally_idle_donors():
    idx, _, clock = catalog("decay", half_life_s=60.0)
    a, b, c = record(1), record(2), record(3)
    for r in (a, b, c):
        idx.add(r)
    a.hits, b.hits, c.hits = 5, 0, 2
    assert idx.add(record(4)) == [b.key]


def test_divergence_demotes_then_evicts():
    idx, vectors, _ = catalog("divergence", threshold=0.3)
    bad, good = record(1), record(2)
    add_embedded(idx, bad, 1)
    add_embedded(idx, good, 2)
    for _ in range(MIN_DEVIATION_REPORTS - 1):
        assert idx.report_deviation(bad.key, 0.9) == []
    assert not bad.demoted  # too few reports to judge
    assert idx.report_deviation(bad.key, 0.9) == []
    assert bad.demoted and ("", bad.key) not in vectors  # no longer offered
    idx.report_deviation(good.key, 0.05)
    # demoted donors go first, even if more recently used
    idx.touch(bad.key)
    idx.add(record(3))
    assert idx.add(record(4)) == [bad.key]


def test_divergence_evicts_a_demoted_donor_reported_high_again():
    idx, _, _ = catalog("divergence", threshold=0.3)
    bad = record(1)
    idx.add(bad)
    for _ in range(MIN_DEVIATION_REPORTS):
        idx.report_deviation(bad.key, 0.8)
    assert bad.demoted
    assert idx.report_deviation(bad.key, 0.8) == [bad.key] and bad.key not in idx


def test_low_deviation_is_kept_under_every_policy():
    for name in ("lru", "decay", "divergence"):
        idx, _, _ = catalog(name)
        r = record(1)
        idx.add(r)
        for _ in range(5):
            assert idx.report_deviation(r.key, 0.1) == []
        assert not r.demoted and r.deviation_reports == 5
