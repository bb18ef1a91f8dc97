"""Client-side TTFT of an exact-prefix hit versus cold prefill, through a real `vllm serve`.

Workload: N real documents (Wikipedia extracts cut to 12 blocks of 128 tokens = 1,536 tokens).
For each, request A is the document + question 1 (it becomes the donor), request B is the same
document + question 2, both sent as token ids. The document ends on a block boundary so that the
in-tree ExampleConnector (which only finds a stored prompt by its block-aligned length) can hit
too; every connector then serves the same 1,536 tokens and computes the question. The
figure is B's time to first token (streaming, measured by the client) under three servers, all
started in this run on the same machine with the same flags (float32, eager, no vLLM prefix
cache):

* cold: no connector (vLLM computes B's prefill);
* example: vLLM's in-tree ExampleConnector (safetensors on disk), the reference to beat;
* semshare: SemShareConnector (host-memory store).

Prints per-server medians and the cold/hit ratios, plus whether each hit's text equals cold's.

    make bench          # or: .venv/bin/python benchmarks/exact_prefix_ttft.py --docs 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from semshare_vllm.testbed import models
from semshare_vllm.testbed.server import SEMSHARE, VllmServer, stop_servers_on_terminate
from semshare_vllm.testbed.text import wiki_document

Q1 = "\n\nQuestion: What is the text above mainly about? Answer:"
Q2 = "\n\nWrite a one-sentence summary of the text above:"


def run_server(
    name: str,
    model: str,
    kv: dict | None,
    docs: list[list[int]],
    q1: list[int],
    q2: list[int],
    server_args: list[str],
    args,
    workdir: Path,
):
    log = workdir / f"{name}.log"
    with VllmServer(model, kv, server_args, log, max_model_len=4096) as srv:
        srv.complete("Hello, world. " * 20, max_tokens=2)  # warm-up, not measured
        ttfts, texts, cached, prompt_lens = [], [], [], []
        for doc in docs:
            if kv is not None:
                srv.complete(doc + q1, max_tokens=args.max_tokens)  # the donor
            b = srv.complete(doc + q2, max_tokens=args.max_tokens)
            ttfts.append(b.ttft_s)
            texts.append(b.text)
            cached.append(b.cached_tokens or 0)
            prompt_lens.append(b.prompt_tokens or 0)
    return {"ttft_s": ttfts, "texts": texts, "cached_tokens": cached, "prompt_tokens": prompt_lens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--docs", type=int, default=5, help="documents (one measured hit each)")
    parser.add_argument(
        "--doc-tokens",
        type=int,
        default=1536,
        help="tokens per document (a multiple of the block size, 128)",
    )
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--model", default=None, help="model dir (default: SmolLM2-135M)")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument(
        "--server-args",
        nargs=argparse.REMAINDER,
        default=[],
        help="extra `vllm serve` flags for all three servers (last option)",
    )
    args = parser.parse_args()
    model = args.model or str(models.smollm2())
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    docs = [
        tok(wiki_document(1000 + 50 * i, 6 * args.doc_tokens), add_special_tokens=False)[
            "input_ids"
        ][: args.doc_tokens]
        for i in range(args.docs)
    ]
    q1, q2 = (tok(q, add_special_tokens=False)["input_ids"] for q in (Q1, Q2))
    server_args = ["--block-size", "128", *args.server_args]

    workdir = Path(tempfile.mkdtemp(prefix="semshare-bench-"))  # kept: server logs live here
    print(f"server logs and stores: {workdir}", file=sys.stderr)
    example = {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(workdir / "example")},
    }
    results = {}
    for name, kv in [("cold", None), ("example", example), ("semshare", SEMSHARE)]:
        print(f"[{name}] starting server ...", file=sys.stderr, flush=True)
        results[name] = run_server(name, model, kv, docs, q1, q2, server_args, args, workdir)

    cold = statistics.median(results["cold"]["ttft_s"])
    print(
        f"\nmodel={Path(model).name} docs={args.docs} "
        f"prompt_tokens(median)={statistics.median(results['cold']['prompt_tokens'])}"
    )
    print(
        f"{'server':10s} {'median TTFT':>12s} {'min':>8s} {'max':>8s} {'cold/this':>10s} "
        f"{'cached tok':>10s} {'same text':>9s}"
    )
    for name, r in results.items():
        med = statistics.median(r["ttft_s"])
        same = sum(t == c for t, c in zip(r["texts"], results["cold"]["texts"]))
        print(
            f"{name:10s} {med:11.3f}s {min(r['ttft_s']):7.3f}s {max(r['ttft_s']):7.3f}s "
            f"{cold / med:9.1f}x {statistics.median(r['cached_tokens']):10.0f} "
            f"{same:>4d}/{len(r['texts'])}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    with stop_servers_on_terminate():  # a killed run stops its servers too
        main()
