"""Speed of donor discovery's two costs: embedding a prompt, and searching the donor index.

1. Embedding latency per prompt of 512 / 2K / 8K SmolLM2 tokens of real text (Wikipedia
   extracts), for each runner (ONNX Runtime, sentence-transformers) on this machine's device:
   detokenise (the served model's tokenizer) + MiniLM over windows covering the whole prompt.
2. Search latency (top-4 cosine in one namespace) at 10k and 1M donors: exact (numpy) and FAISS
   IVF (what ``index_kind="auto"`` uses past ``exact_search_max``), with IVF's recall@1 against
   exact. The vectors are synthetic but clustered like real prompt embeddings (topics + noise):
   1M real embeddings would take hours to compute here.

Prints medians over repeated runs.

    .venv/bin/python benchmarks/discovery_speed.py [--runners onnx,sentence-transformers]
        [--donors 10000,1000000] [--repeats 5]

ONNX Runtime runs with one thread on CPU inside the server (``onnx``); ``onnx@2`` shows two.
sentence-transformers uses torch's thread count (all cores here; vLLM's engine sets its own).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from semshare_vllm.discovery.embedder import make_embedder
from semshare_vllm.discovery.vector_index import VectorIndex
from semshare_vllm.testbed import models
from semshare_vllm.testbed.text import wiki_document
from semshare_vllm.testbed.timing import median_ms


def embedding_latency(runners: list[str], lengths: list[int], repeats: int, device: str) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(models.smollm2()))
    ids = tok(wiki_document(2000, 60_000))["input_ids"]
    prompts = {n: ids[:n] for n in lengths}
    print(f"\n## Embedding latency per prompt (device: {device}; median of {repeats})")
    print("| runner | " + " | ".join(f"{n} tokens" for n in lengths) + " |")
    print("|---|" + "---|" * len(lengths))
    detok = {
        n: median_ms(lambda p=p: tok.decode(p, skip_special_tokens=True), repeats)
        for n, p in prompts.items()
    }
    for runner in runners:  # "onnx" (the server's setting: 1 thread on CPU) or "onnx@2"
        kind, _, threads = runner.partition("@")
        emb = make_embedder(kind, device=device, threads=int(threads or 0))
        cells = []
        for n, p in prompts.items():
            text = tok.decode(p, skip_special_tokens=True)
            ms = median_ms(lambda t=text: emb.embed(t), repeats)
            windows = len(emb.embed(text).segments)
            cells.append(f"{ms + detok[n]:.1f} ms ({windows} windows)")
        print(f"| {runner} | " + " | ".join(cells) + " |")
    print(
        "(detokenisation included: "
        + ", ".join(f"{n}: {ms:.2f} ms" for n, ms in detok.items())
        + ")"
    )


def clustered(n: int, dim: int = 384, topics: int = 4096, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centers = rng.standard_normal((topics, dim)).astype(np.float32)
    out = np.empty((n, dim), dtype=np.float32)
    for start in range(0, n, 100_000):  # in slices: bounded temporaries
        m = min(100_000, n - start)
        x = centers[rng.integers(0, topics, m)] + 0.8 * rng.standard_normal(
            (m, dim), dtype=np.float32
        )
        out[start : start + m] = x / np.linalg.norm(x, axis=1, keepdims=True)
    return out


def search_latency(sizes: list[int], repeats: int, queries: int = 50) -> None:
    print(f"\n## Search latency, top-4 in one namespace (median over {queries} queries)")
    print("| donors | exact (numpy) | FAISS IVF | IVF build | IVF recall@1 vs exact |")
    print("|---|---|---|---|---|")
    rng = np.random.default_rng(1)
    for n in sizes:
        vectors = clustered(n)
        q = vectors[rng.integers(0, n, queries)] + 0.3 * rng.standard_normal(
            (queries, 384), dtype=np.float32
        ) / np.sqrt(384)
        exact = VectorIndex(kind="exact")
        ivf = VectorIndex(kind="faiss-ivf")
        for index in (exact, ivf):
            for i, v in enumerate(vectors):
                index.add("", i, v, 0)
        t0 = time.perf_counter()
        ivf.build_pending()
        build_s = time.perf_counter() - t0
        timings = {}
        results = {}
        for name, index in (("exact", exact), ("ivf", ivf)):
            index.search("", q[0], 4)
            ts, tops = [], []
            for v in q:
                t1 = time.perf_counter()
                found = index.search("", v, 4)
                ts.append((time.perf_counter() - t1) * 1e3)
                tops.append(found[0].key)
            timings[name], results[name] = statistics.median(ts), tops
        recall = np.mean([a == b for a, b in zip(results["exact"], results["ivf"])])
        print(
            f"| {n:,} | {timings['exact']:.3f} ms | {timings['ivf']:.3f} ms | "
            f"{build_s:.1f} s | {recall:.2f} |"
        )
        del exact, ivf, vectors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--runners",
        default="onnx,onnx@2,sentence-transformers",
        help="runner[@threads]; sentence-transformers uses torch's threads",
    )
    parser.add_argument("--lengths", default="512,2048,8192")
    parser.add_argument("--donors", default="10000,1000000")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()
    from semshare_vllm.discovery.embedder import resolve_device

    t0 = time.perf_counter()
    embedding_latency(
        args.runners.split(","),
        [int(x) for x in args.lengths.split(",")],
        args.repeats,
        resolve_device(args.device),
    )
    search_latency([int(x) for x in args.donors.split(",")], args.repeats)
    print(f"\n(wall time {time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
