"""Loaders of the real text shipped in PyPI packages (used by tests and benchmarks)."""

from semshare_vllm.testbed import text


def test_wiki_extracts_and_documents():
    extracts = text.wiki_extracts()
    assert len(extracts) > 10_000
    doc = text.wiki_document(3, 5000)
    assert len(doc) >= 5000 and doc.startswith(extracts[3][0])


def test_lee_corpus_and_human_ratings():
    docs, sims = text.lee_documents(), text.lee_similarity()
    assert len(docs) == 50 and len(text.lee_background()) == 300
    assert all(len(d) > 200 for d in docs)
    assert len(sims) == 50 and all(len(r) == 50 for r in sims)
    assert all(sims[i][i] == 1.0 for i in range(50))
    assert all(
        sims[i][j] == sims[j][i] and 0.0 <= sims[i][j] <= 1.0 for i in range(50) for j in range(50)
    )


def test_sharegpt_tolerant_reader():
    first = list(text.sharegpt_conversations(limit=50))
    assert len(first) == 50
    assert all(
        c["conversations"] and {"from", "value"} <= set(c["conversations"][0]) for c in first
    )
    assert sum(1 for _ in text.sharegpt_conversations()) == 17_671  # stops at the truncation
