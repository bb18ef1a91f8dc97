"""The shared-4-gram pre-test of donor search: a donor's sampled grams, the best share over a
namespace's donors (sorted and recent ones, removals), and the lookup answering without
embedding when no donor could be aligned."""

import random

import numpy as np

from semshare_vllm.discovery import ngrams
from semshare_vllm.discovery.ngrams import GramTable, sample_grams
from semshare_vllm.discovery.vector_index import VectorIndex
from semshare_vllm.testbed import pairs as P
from semshare_vllm.testbed.models import smollm2_tokenizer
from semshare_vllm.testbed.text import wiki_document


def best_share(table, grams):
    top = table.top(grams, 1)
    return top[0][1] if top else 0.0


def test_samples_are_content_defined_and_shares_separate_real_text():
    tok = smollm2_tokenizer()
    doc, other = wiki_document(3000, 6000), wiki_document(5000, 6000)
    ids = tok(doc)["input_ids"]
    g = sample_grams(ids)
    assert len(g) > 0 and np.all(np.diff(g.astype(np.float64)) >= 0)
    # the same text after another head samples the same grams
    shifted = sample_grams(tok("A different opening line.\n\n" + doc)["input_ids"])
    assert len(np.intersect1d(g, shifted)) >= 0.95 * len(g)
    table = GramTable()
    table.add("doc", g)
    unrelated = best_share(table, sample_grams(tok(other)["input_ids"]))
    words = (doc + " " + other).split()
    half = best_share(
        table, sample_grams(tok(P.reword_document(doc, 0.5, random.Random(0), words))["input_ids"])
    )
    assert unrelated < 0.02 < 0.05 < half
    assert sample_grams([1, 2, 3]).size == 0


def test_best_share_over_sorted_and_recent_donors_with_removals(monkeypatch):
    monkeypatch.setattr(ngrams, "MERGE_AFTER", 3)
    rng = np.random.default_rng(0)
    donors = {i: np.unique(rng.integers(0, 2**40, 200).astype(np.uint64)) for i in range(10)}
    table = GramTable()
    for key, g in donors.items():
        table.add(key, g)
    assert len(table) == 10
    query = np.unique(np.concatenate([donors[2][:150], donors[7][:50]]))
    assert table.top(query, 1) == [(2, 150 / len(query))]
    table.remove(2)  # merged rows of a removed donor no longer count
    assert table.top(query, 1) == [(7, 50 / len(query))]
    table.add(11, donors[2][:100])  # a recent donor counts before any merge
    assert table.top(query, 1) == [(11, 100 / len(query))]
    assert [k for k, _ in table.top(query, 2)] == [11, 7]
    assert table.top(np.zeros(0, dtype=np.uint64), 1) == []


def test_vector_index_keeps_grams_per_namespace():
    index = VectorIndex(dim=4, kind="exact")
    g = np.arange(0, 400, 4, dtype=np.uint64)
    assert index.shared_grams("a", g, 3) is None
    index.add("a", "k", np.ones(4) / 2, 0, grams=g)
    index.add("a", "half", np.ones(4) / 2, 0, grams=g[::2])
    index.add("b", "j", np.ones(4) / 2, 0)  # a donor that gave no grams
    found = index.shared_grams("a", g, 3)
    assert [(c.key, c.score, c.method) for c in found] == [
        ("k", 1.0, "grams"),
        ("half", 0.5, "grams"),
    ]
    assert index.shared_grams("a", g, 1)[0].key == "k"
    assert index.shared_grams("b", g, 3) is None
    index.remove("a", "k")
    assert [c.key for c in index.shared_grams("a", g, 3)] == ["half"]
