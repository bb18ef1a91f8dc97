"""The model's input-embedding matrix (SemShareKV's "E cache" source), without the model.

The scheduler process has no weights, yet the fuzzy and sentence stages need each token's input
embedding. ``EmbeddingTable.load`` reads only the embedding tensor out of the model's
safetensors files (lazily, once per process and model). Large vocabularies can be kept as a
compact sketch instead: a fixed random projection to ``sketch_dim`` dims (Johnson-Lindenstrauss:
inner products, hence SimHash codes and cosines, are preserved approximately), built slice by
slice so the full matrix is never held in memory at once. (With a sketch, the LSH stage rotates
the projected vectors: an approximation of the paper's RoPE on the full rows.)
"""

from __future__ import annotations

import functools
import json
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from semshare_vllm.core.tensor_files import open_tensors

# Names the input embedding goes by in Llama / Mistral / Qwen / Gemma, GPT-2 / NeoX, BLOOM.
_EMBEDDING_NAMES = (
    "embed_tokens.weight",
    "wte.weight",
    "embed_in.weight",
    "word_embeddings.weight",
)
# Keep the whole matrix (fp32) up to this many elements (SmolLM2: 28M); sketch beyond.
FULL_MATRIX_MAX = 64_000_000
DEFAULT_SKETCH_DIM = 256
_SLICE_ROWS = 8192
COMMON_DIRECTIONS = 10


class EmbeddingUnavailable(RuntimeError):
    """No embedding tensor could be read: the fuzzy stages are skipped."""


@dataclass(frozen=True, eq=False)
class EmbeddingTable:
    vectors: np.ndarray  # [vocab, dim] float32 (the embedding rows, or their sketch)
    sketched: bool
    rope_base: float  # the model's rotary base (config.json), for RoPE on E

    @property
    def dim(self) -> int:
        return self.vectors.shape[1]

    @functools.cached_property
    def common_directions(self) -> tuple[np.ndarray, np.ndarray]:
        """(mean row, top principal directions ``[dim, 10]``) of the vocabulary: what every
        token shares. Averaged embeddings are dominated by it (unrelated sentences come out
        nearly parallel); removing it ("all-but-the-top", Mu & Viswanath 2018) separates edited
        sentences from unrelated ones (figures: docs/benchmarks.md, "Alignment")."""
        rows = self.vectors[np.random.default_rng(0).permutation(len(self.vectors))[:16384]]
        mean = self.vectors.mean(axis=0)
        x = rows - mean
        _, vecs = np.linalg.eigh(x.T @ x)
        return mean, np.ascontiguousarray(vecs[:, ::-1][:, :COMMON_DIRECTIONS])

    def rows(self, token_ids: np.ndarray) -> np.ndarray:
        ids = np.clip(np.asarray(token_ids, dtype=np.int64), 0, len(self.vectors) - 1)
        return self.vectors[ids]

    @classmethod
    def load(cls, model_dir: str | Path, sketch_dim: int | None = None) -> "EmbeddingTable":
        """The table for the model in ``model_dir``; cached per process. ``sketch_dim``: None or
        -1 (the config's ``embedding_sketch_dim`` default) = the full matrix up to
        ``FULL_MATRIX_MAX`` elements, a sketch of ``DEFAULT_SKETCH_DIM`` dims beyond; 0 = always
        full; n = always a sketch of n dims."""
        return _load(
            str(Path(model_dir).resolve()),
            None if sketch_dim is None or sketch_dim < 0 else sketch_dim,
        )


_lock = threading.Lock()


@functools.lru_cache(maxsize=4)
def _load_cached(model_dir: str, sketch_dim: int | None) -> EmbeddingTable:
    root = Path(model_dir)
    files = sorted(root.glob("*.safetensors"))
    for path in files:
        with open_tensors(path) as f:
            name = next((k for k in f.keys() if k.endswith(_EMBEDDING_NAMES)), None)
            if name is None:
                continue
            sl = f.get_slice(name)
            vocab, dim = sl.get_shape()
            if sketch_dim is None:
                sketch_dim = 0 if vocab * dim <= FULL_MATRIX_MAX else DEFAULT_SKETCH_DIM
            if sketch_dim <= 0 or sketch_dim >= dim:
                vectors = _to_f32(sl[:])
            else:  # project slice by slice: never the whole matrix in fp32
                proj = np.random.default_rng(0).standard_normal((dim, sketch_dim)).astype(
                    np.float32
                ) / np.sqrt(sketch_dim)
                vectors = np.empty((vocab, sketch_dim), dtype=np.float32)
                for a in range(0, vocab, _SLICE_ROWS):
                    b = min(vocab, a + _SLICE_ROWS)
                    vectors[a:b] = _to_f32(sl[a:b]) @ proj
            return EmbeddingTable(
                np.ascontiguousarray(vectors), 0 < sketch_dim < dim, _rope_base(root)
            )
    raise EmbeddingUnavailable(
        f"no input-embedding tensor in {model_dir} ({len(files)} safetensors files)"
    )


def _load(model_dir: str, sketch_dim: int | None) -> EmbeddingTable:
    with _lock:  # one load even when several threads ask at once
        return _load_cached(model_dir, sketch_dim)


def _to_f32(t) -> np.ndarray:
    import torch

    # torch reads bf16 / fp16 tensors, numpy cannot; a copy also of fp32, which a safetensors
    # before 0.8 hands out as a view of its map of the checkpoint (core/tensor_files.py)
    return t.to(torch.float32, copy=True).numpy()


def _rope_base(root: Path) -> float:
    try:
        cfg = json.loads((root / "config.json").read_text())
    except (OSError, ValueError):
        return 10000.0
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    return float(cfg.get("rope_theta") or params.get("rope_theta") or 10000.0)
