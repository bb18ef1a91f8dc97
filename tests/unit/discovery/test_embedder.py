"""The embedder on the real MiniLM: both runners agree, windows cover the whole prompt."""

import numpy as np
import pytest

from semshare_vllm.discovery.embedder import OnnxEmbedder, make_embedder, onnx_export
from semshare_vllm.testbed.text import lee_documents, wiki_document


@pytest.fixture(scope="module")
def onnx():
    return make_embedder("onnx", device="cpu")


@pytest.fixture(scope="module")
def st():
    return make_embedder("sentence-transformers", device="cpu")


TEXTS = [
    wiki_document(11, 300),
    wiki_document(40, 2500),
    wiki_document(90, 9000),
    *lee_documents()[:3],
]


def test_runners_agree(onnx, st):
    for a, b in zip(onnx.embed_many(TEXTS), st.embed_many(TEXTS)):
        assert float(a.vector @ b.vector) >= 0.999
        assert a.segments.shape == b.segments.shape
        assert float(np.min((a.segments * b.segments).sum(1))) >= 0.999


def test_windows_cover_the_whole_prompt(onnx):
    ids = np.asarray(onnx.tokenizer.encode(TEXTS[2], add_special_tokens=False).ids)
    windows = onnx._windows(ids)
    body = onnx.window - 2
    assert len(ids) > 4 * body  # long enough to need many windows
    covered = np.zeros(len(ids), dtype=bool)
    start = 0
    for w in windows:
        assert len(w) <= onnx.window and w[0] == onnx.cls_id and w[-1] == onnx.sep_id
        inner = w[1:-1]
        assert np.array_equal(inner, ids[start : start + len(inner)])
        covered[start : start + len(inner)] = True
        start += body - onnx.overlap
    assert covered.all()
    emb = onnx.embed(TEXTS[2])
    assert emb.segments.shape == (len(windows), 384) and emb.num_tokens == len(ids)
    assert abs(float(np.linalg.norm(emb.vector)) - 1) < 1e-5
    assert np.allclose(np.linalg.norm(emb.segments, axis=1), 1, atol=1e-5)


def test_the_tail_of_a_long_prompt_counts(onnx):
    """A prompt's end moves its vector (a peer embeds only the first 4,000 characters)."""
    head = wiki_document(200, 6000)
    a = onnx.embed(head + "\n\n" + wiki_document(700, 6000))
    b = onnx.embed(head + "\n\n" + wiki_document(900, 6000))
    assert float(a.vector @ b.vector) < 0.95


def test_batched_equals_one_by_one(onnx):
    batched = onnx.embed_many(TEXTS[:3])
    for text, emb in zip(TEXTS[:3], batched):
        assert float(onnx.embed(text).vector @ emb.vector) > 0.99999


def test_empty_text(onnx):
    emb = onnx.embed("")
    assert emb.num_tokens == 0 and len(emb.segments) == 0 and not emb.vector.any()


def test_onnx_export_is_cached(onnx):
    path = onnx_export(onnx.model_dir)
    before = path.stat().st_mtime_ns
    again = OnnxEmbedder(onnx.model_dir, device="cpu")
    assert path.stat().st_mtime_ns == before  # exported once, reused
    assert float(again.embed(TEXTS[0]).vector @ onnx.embed(TEXTS[0]).vector) > 0.99999


def test_a_broken_cached_export_is_made_again(onnx, tmp_path, monkeypatch):
    """A crash can leave the cached export empty or cut short (renamed before it reached the
    disk); every start-up after it then ran without semantic discovery until someone deleted
    the file. It is exported again."""
    good = onnx_export(onnx.model_dir)
    monkeypatch.setenv("SEMSHARE_CACHE_DIR", str(tmp_path))
    broken = tmp_path / "onnx" / good.name
    broken.parent.mkdir()
    broken.write_bytes(good.read_bytes()[: good.stat().st_size // 3])
    again = OnnxEmbedder(onnx.model_dir, device="cpu")
    assert broken.stat().st_size == good.stat().st_size
    assert float(again.embed(TEXTS[0]).vector @ onnx.embed(TEXTS[0]).vector) > 0.99999
