"""Donor search: exact and FAISS agree, namespaces are hard walls, SimHash finds near-duplicates."""

import numpy as np
import pytest

from semshare_vllm.discovery.simhash import hamming, simhash
from semshare_vllm.discovery.vector_index import VectorIndex


def unit(rows, dim=384, seed=0):
    x = np.random.default_rng(seed).standard_normal((rows, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def filled(kind, vectors, **kw):
    index = VectorIndex(kind=kind, **kw)
    for i, v in enumerate(vectors):
        index.add("ns", ("donor", i), v, i)
    for i in range(0, len(vectors), 3):  # removals leave holes the tables must handle
        index.remove("ns", ("donor", i))
    index.build_pending()
    return index


def test_exact_and_faiss_return_the_same_results():
    vectors = unit(3000)
    queries = vectors[1:60] + 0.05 * unit(59, seed=1)
    kinds = {
        "exact": {},
        "faiss-flat": {},
        # every list probed: the IVF table must then equal exact search
        "faiss-ivf": {"nprobe": 4096},
        "auto": {"exact_max": 1000, "nprobe": 4096},
    }
    indexes = {k: filled(k, vectors, **kw) for k, kw in kinds.items()}
    assert indexes["faiss-ivf"]._tables["ns"].faiss is not None
    assert indexes["auto"]._tables["ns"].faiss is not None  # grew past exact_max
    for q in queries:
        results = {
            k: [(c.key, round(c.score, 5)) for c in ix.search("ns", q, 5)]
            for k, ix in indexes.items()
        }
        assert len(set(map(tuple, results.values()))) == 1, results
        assert results["exact"][0][0] != ("donor", 0)


def test_threshold_and_order():
    vectors = unit(50)
    index = filled("exact", vectors)
    q = vectors[4]
    found = index.search("ns", q, 10, threshold=0.5)
    assert [c.key for c in found] == [("donor", 4)] and found[0].score == pytest.approx(1.0)
    scores = [c.score for c in index.search("ns", q, 10)]
    assert scores == sorted(scores, reverse=True) and len(scores) == 10


@pytest.mark.parametrize("kind", ["exact", "faiss-flat"])
def test_namespaces_are_hard_walls(kind):
    index = VectorIndex(kind=kind)
    v = unit(2)
    index.add("tenant-a", "a", v[0], 1)
    index.add("", "anon", v[1], 2)
    assert [c.key for c in index.search("tenant-a", v[1], 5)] == ["a"]
    assert [c.key for c in index.search("", v[0], 5)] == ["anon"]  # "" is not "all"
    assert index.search("tenant-b", v[0], 5) == []
    assert index.near_duplicates("tenant-b", 1, 64) == []
    assert index.remove("tenant-a", "a") and index.size("tenant-a") == 0
    assert index.search("tenant-a", v[0], 5) == []


def test_re_adding_a_key_replaces_it():
    index = VectorIndex(kind="faiss-flat")
    v = unit(2)
    index.add("ns", "k", v[0], 1)
    index.add("ns", "k", v[1], 2)
    assert index.size("ns") == 1
    assert index.search("ns", v[1], 2)[0].score == pytest.approx(1.0)


def test_simhash_near_duplicates():
    rng = np.random.default_rng(0)
    doc = rng.integers(0, 49152, 1500)
    edited = doc.copy()
    edited[700:705] = 11  # a few tokens changed
    other = rng.integers(0, 49152, 1500)
    assert hamming(simhash(doc), simhash(edited)) <= 6
    assert hamming(simhash(doc), simhash(other)) > 12
    index = VectorIndex(kind="exact")
    index.add("ns", "doc", unit(1)[0], simhash(doc))
    index.add("ns", "other", unit(1, seed=3)[0], simhash(other))
    found = index.near_duplicates("ns", simhash(edited), 6)
    assert [c.key for c in found] == ["doc"] and found[0].method == "simhash"


@pytest.mark.parametrize("kind", ["exact", "faiss-flat"])
def test_a_donor_offered_by_its_grams_alone(kind):
    """Before its vector comes, a donor is found by its grams, never by meaning or SimHash;
    its vector then joins it (one donor); removed either way, its namespace's table goes."""
    from semshare_vllm.discovery.ngrams import sample_grams

    idx = VectorIndex(dim=8, kind=kind)
    tokens = list(range(100, 400))
    idx.add_grams("a", "d", tokens)
    assert idx.has_donors("a") and idx.size("a") == 0 and not idx.has_donors("b")
    assert [c.key for c in idx.shared_grams("a", sample_grams(tokens), 3)] == ["d"]
    assert idx.search("a", np.ones(8), 3) == [] and idx.near_duplicates("a", 0, 64) == []
    idx.add_donor("a", "d", np.ones(8) / np.sqrt(8), simhash(tokens), tokens)
    idx.add_grams("a", "d", tokens)  # (already embedded: nothing changes)
    assert idx.size("a") == 1 and [c.key for c in idx.search("a", np.ones(8), 3)] == ["d"]
    assert len(idx.shared_grams("a", sample_grams(tokens), 3)) == 1
    assert idx.remove("a", "d") and not idx.has_donors("a")
    idx.add_grams("a", "e", tokens)
    assert idx.remove("a", "e") and not idx.has_donors("a") and not idx.remove("a", "e")
    assert idx.shared_grams("a", sample_grams(tokens), 3) is None
