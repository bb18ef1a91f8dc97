"""Persisted donors are keyed by the weights that computed them: a new checkpoint written at the
same path (same file names, same sizes) restores none of the old donors, and the answer is the
new weights' cold answer. Each engine lifetime runs in its own process (``scenarios/``)."""

import shutil
from pathlib import Path

import pytest
from support.lifetimes import lifetime as run_lifetime

from semshare_vllm.testbed import models, offline
from semshare_vllm.testbed.text import wiki_document

pytestmark = pytest.mark.engine

MAX_TOKENS = 8


def lifetime(model, persist_dir, tmp_path, **job):
    return run_lifetime(model, persist_dir, tmp_path, MAX_TOKENS, **job)


def rewrite_weights(model_dir: Path) -> None:
    """Other random weights, saved over the old file: same names, shapes and size."""
    import torch
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    size = path.stat().st_size
    tensors = load_file(str(path))
    g = torch.Generator().manual_seed(1)
    for name, t in tensors.items():
        if t.dim() == 2:
            tensors[name] = (torch.randn(t.shape, generator=g) * 0.08).to(t.dtype)
    save_file(tensors, str(path), metadata={"format": "pt"})
    assert path.stat().st_size == size


def model_and_prompts(tmp_path):
    """A copy of the tiny Llama to rewrite, two prompts on one document (the second served from
    the first's donor), and a filler prompt (the step that starts a capture)."""
    from transformers import AutoTokenizer

    model = tmp_path / "model"
    shutil.copytree(models.tiny_llama(), model)
    tok = AutoTokenizer.from_pretrained(str(model))

    def ids(text):
        return tok(text, add_special_tokens=False)["input_ids"]

    doc = ids(wiki_document(700, 900))
    a, b = doc + ids("\n\nQuestion: what is this about?"), doc + ids("\n\nSummarize it:")
    return model, a, b, ids("x " * 40)


def test_donors_persisted_under_other_weights_are_not_restored(tmp_path):
    model, a, b, filler = model_and_prompts(tmp_path)
    persist = tmp_path / "donors"

    first = lifetime(model, persist, tmp_path, prompt=a, capture=True, filler=filler)
    assert first["restored"] == 0 and first["worker"]["captured_donors"] >= 1
    same = lifetime(model, persist, tmp_path, prompt=b)  # control: same weights, restart
    assert same["restored"] >= 1 and same["scheduler"]["hit_tokens"] > 0
    assert same["fingerprint"] == first["fingerprint"]

    rewrite_weights(model)
    other = lifetime(model, persist, tmp_path, prompt=b)
    assert other["fingerprint"] != first["fingerprint"]
    assert other["restored"] == 0 and other["scheduler"].get("hit_tokens", 0) == 0
    cold = offline.reference_outputs(str(model), [b], MAX_TOKENS)[0]
    assert other["out"]["token_ids"] == cold["token_ids"]
    assert other["out"]["num_cached_tokens"] == 0


def test_donors_of_random_weights_are_never_persisted(tmp_path):
    """``load_format`` "dummy" (random weights, as a benchmark or profiling run starts) at the
    path of the real checkpoint: keyed by that path's files alone, its donors were restored by
    the next lifetime on the real weights and served as exact prefixes, 224 tokens, and its
    answer was not the real weights' cold answer (the reviewer's run on main). Now such an
    engine persists and shares nothing."""
    model, a, b, filler = model_and_prompts(tmp_path)
    persist = tmp_path / "donors"

    dummy = lifetime(
        model,
        persist,
        tmp_path,
        prompt=a,
        capture=True,
        filler=filler,
        engine_args={"load_format": "dummy"},
    )
    assert dummy["worker"]["captured_donors"] >= 1  # kept in memory, as ever
    assert not list(persist.rglob("*.safetensors"))  # never written
    real = lifetime(model, persist, tmp_path, prompt=b)
    assert real["fingerprint"] != dummy["fingerprint"]
    assert real["restored"] == 0 and real["scheduler"].get("hit_tokens", 0) == 0
    cold = offline.reference_outputs(str(model), [b], MAX_TOKENS)[0]
    assert real["out"]["token_ids"] == cold["token_ids"]
