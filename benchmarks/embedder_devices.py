"""The embedder on a GPU against the server's CPU embedder: the same prompts' vectors, and time.

Donors found by one instance serve another (a shared index carries the vectors, and the
embedder's identity leaves out which runner and device made them), so a GPU instance's vectors
must agree with a CPU instance's. A lent GPU machine has torch, sentence-transformers and
tokenizers, but neither vLLM nor this project's model packages, and takes at most 64 MiB
along; so its inputs are made here:

    .venv/bin/python benchmarks/embedder_devices.py prepare DIR     # here
    python3 benchmarks/embedder_devices.py check DIR [--repeats 10]  # there (PYTHONPATH=src)

``prepare`` writes ``DIR/cases.pt``: real text (Wikipedia extracts) of 512 / 2K / 8K SmolLM2
tokens with its document and window vectors from the server's default runner here (ONNX
Runtime, fp32, CPU), and ``DIR/minilm``: all-MiniLM-L6-v2 with its weights stored in fp16
(the sentence-transformers runner computes in fp16 on a GPU whatever it loads; halved, the
model fits the transfer). ``check`` embeds the texts with the sentence-transformers runner on
the device and on that machine's CPU, and prints per length the cosine of each document vector
with the one made here, the lowest cosine over windows, and the median latency of a whole
prompt (tokenise, window, encode, pool).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import numpy as np
import torch

from semshare_vllm.discovery.embedder import make_embedder
from semshare_vllm.testbed.timing import median_ms

LENGTHS = (512, 2048, 8192)


def prepare(out: Path) -> None:
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    from semshare_vllm.discovery.embedder import packaged_minilm
    from semshare_vllm.testbed import models
    from semshare_vllm.testbed.text import wiki_document

    out.mkdir(parents=True, exist_ok=True)
    src = packaged_minilm()
    dst = out / "minilm"
    shutil.copytree(src, dst, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.safetensors"))
    weights = load_file(str(src / "model.safetensors"))
    save_file(
        {k: v.half().contiguous() for k, v in weights.items()}, str(dst / "model.safetensors")
    )

    tok = AutoTokenizer.from_pretrained(str(models.smollm2()))
    ids = tok(wiki_document(2000, 60_000))["input_ids"]
    texts = {n: tok.decode(ids[:n], skip_special_tokens=True) for n in LENGTHS}
    emb = make_embedder("onnx", device="cpu")
    cases = {}
    for n, text in texts.items():
        e = emb.embed(text)
        cases[n] = {"text": text, "vector": e.vector, "segments": e.segments}
        print(f"{n} tokens: {len(e.segments)} windows, {e.num_tokens} encoder tokens")
    torch.save(cases, out / "cases.pt")


def check(folder: Path, repeats: int) -> None:
    cases = torch.load(folder / "cases.pt", weights_only=False)
    devices = ["cuda", "cpu"] if torch.cuda.is_available() else ["cpu"]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads")
    if torch.cuda.is_available():
        print(f"GPU: {torch.cuda.get_device_name()}")
    print(
        "| device | tokens | windows | document cosine to here's | lowest window cosine "
        "| median latency |"
    )
    print("|---|---|---|---|---|---|")
    for device in devices:
        emb = make_embedder("sentence-transformers", str(folder / "minilm"), device=device)
        if device == "cpu":  # as the server computes on CPU: fp32 (the fp16 file loads as fp16)
            emb.model.float()
        for n, case in sorted(cases.items()):
            e = emb.embed(case["text"])
            assert e.segments.shape == case["segments"].shape, (e.segments.shape, n)
            doc = float(np.dot(e.vector, case["vector"]))
            window = float(np.min(np.sum(e.segments * case["segments"], axis=1)))
            ms = median_ms(lambda t=case["text"]: emb.embed(t), repeats)
            print(
                f"| {device} ({emb.name}) | {n} | {len(e.segments)} | {doc:.6f} | {window:.6f} "
                f"| {ms:.1f} ms |"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", choices=["prepare", "check"])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    if args.mode == "prepare":
        prepare(args.folder)
    else:
        check(args.folder, args.repeats)


if __name__ == "__main__":
    main()
