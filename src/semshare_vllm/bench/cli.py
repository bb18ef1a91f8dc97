"""``semshare-bench``: how much faster, how often, at what cost on a miss, and whether the answer
is still right, against a vLLM server running the SemShare connector.

    semshare-bench --base-url http://127.0.0.1:8000 --workloads cross-instruction,negative
    semshare-bench --launch --context-tokens 1024 2048 --out results.json --plots plots/

``--launch`` starts a local ``vllm serve`` with the connector on loopback (the packaged
SmolLM2-135M unless ``--model`` names another), runs, and stops it by PID. It serves as users
run vLLM: its prefix caching on and its default block size (``--server-args`` adds or
overrides ``vllm serve`` flags, e.g. ``"--block-size 32 --no-enable-prefix-caching"`` to
isolate the connector). Cold figures come
from the same server with the connector opted out per request (``kv_transfer_params``) under a
fresh ``cache_salt``, so vLLM's own prefix cache does not serve them either.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
from pathlib import Path

from semshare_vllm.bench import report, workloads
from semshare_vllm.bench.client import Endpoint, EndpointError
from semshare_vllm.bench.measure import Measured, run, warm_up
from semshare_vllm.bench.workloads import WORKLOADS, Sizer, WorkloadError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="semshare-bench",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--base-url", help="a running server, e.g. http://127.0.0.1:8000")
    target.add_argument(
        "--launch",
        action="store_true",
        help="start a local vllm serve with the connector, stop it after",
    )
    p.add_argument(
        "--model",
        help="--launch: the model (default: the packaged SmolLM2-135M); "
        "--base-url: the served model name (default: the server's first)",
    )
    p.add_argument(
        "--tokenizer",
        help="tokenizer to size prompts with (default: --launch's "
        "model; else 4 characters a token)",
    )
    p.add_argument(
        "--workloads",
        default="cross-instruction,negative",
        help=f"comma-separated, or 'all': {', '.join(WORKLOADS)}",
    )
    p.add_argument(
        "--workload-file",
        help='your own JSONL: {"prompt", "group", "role": "donor"|"target", "answer"?, '
        '"reference"?, "donor_answer"?} per line',
    )
    p.add_argument(
        "--context-tokens",
        type=int,
        nargs="+",
        default=[1024],
        help="prompt sizes to build the workloads at (512 ... 32768)",
    )
    p.add_argument("--groups", type=int, default=2, help="groups per workload and size")
    p.add_argument("--max-tokens", type=int, default=32, help="greedy output tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--donor-wait-s",
        type=float,
        default=60.0,
        help="longest wait for a group's donors to be captured and embedded",
    )
    p.add_argument(
        "--extra-config",
        type=json.loads,
        default={},
        help="--launch: connector keys as JSON (kv_connector_extra_config)",
    )
    p.add_argument(
        "--server-args",
        default="",
        help="--launch: more vllm serve flags, one string (default: none, vLLM's own defaults, "
        'as users run it; e.g. "--block-size 32 --no-enable-prefix-caching")',
    )
    p.add_argument(
        "--no-perplexity",
        dest="perplexity",
        action="store_false",
        help="skip scoring the held-out references (two prompt-logprob requests per target)",
    )
    p.add_argument(
        "--no-noise-floor",
        dest="noise_floor",
        action="store_false",
        help="skip the noise floor (each target cold once more, beside another request)",
    )
    p.add_argument("--out", default="semshare-bench.json", help="JSON result file")
    p.add_argument("--plots", help="directory for PNG plots (needs matplotlib)")
    args = p.parse_args(argv)
    names = (
        WORKLOADS
        if args.workloads == "all"
        else tuple(n.strip() for n in args.workloads.split(",") if n.strip())
    )
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        p.error(f"unknown workload(s) {', '.join(unknown)}; choose from {', '.join(WORKLOADS)}")
    args.workload_names = names
    if any(t < 64 for t in args.context_tokens):
        p.error("--context-tokens must be at least 64")
    return args


class _Progress:
    """A progress bar over one context length's targets, with the last one's figures."""

    def __init__(self, total: int, tokens: int):
        from tqdm import tqdm

        self.bar = tqdm(
            total=total,
            desc=f"{tokens:>6} tokens",
            unit="target",
            dynamic_ncols=True,
            mininterval=1.0,
        )
        self.hits = 0

    def __call__(self, m: Measured, done: int, total: int) -> None:
        self.hits += m.hit
        self.bar.set_postfix_str(
            f"{m.request.workload}: cold {m.cold.ttft_s * 1e3:.0f} ms, served "
            f"{m.served.ttft_s * 1e3:.0f} ms ({_kind(m)}); "
            f"hits {self.hits}/{done}",
            refresh=False,
        )
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def _kind(m: Measured) -> str:
    if m.hit:
        return "hit"
    if m.declined:
        return "declined"
    return "vLLM's cache" if m.vllm_cached else "miss"


def bench(args: argparse.Namespace, endpoint: Endpoint, sizer: Sizer) -> int:
    summaries: dict[int, dict] = {}
    rows: dict[int, list] = {}
    config = {k: v for k, v in vars(args).items() if k != "workload_names"}
    config["model"] = endpoint.model
    config["server_cache"] = endpoint.cache_config()
    print(f"server {endpoint.url}: {_describe(config['server_cache'])}")
    interrupted = False
    limit = endpoint.max_model_len and endpoint.max_model_len - args.max_tokens
    if args.workload_file:  # checked before anything is sent
        from_file = workloads.load_file(args.workload_file)
        workloads.check_fit(from_file, sizer, limit)
    warm_up(endpoint, args.donor_wait_s)
    for tokens in args.context_tokens:
        if args.workload_file:
            requests = from_file
        else:
            requests = []
            for name in args.workload_names:
                built, size = workloads.build_within(
                    name, args.groups, tokens, sizer, args.seed, limit
                )
                if size != tokens:
                    print(f"{name} at ~{tokens} tokens: built at {size} to fit {limit}")
                requests += built
        targets = sum(r.role == "target" for r in requests)
        print(
            f"\n{len(requests)} requests at ~{tokens} tokens ({targets} targets, cold and served):"
        )
        progress = _Progress(targets, tokens)
        try:
            results = run(
                endpoint,
                requests,
                args.max_tokens,
                args.donor_wait_s,
                progress,
                perplexity=args.perplexity,
                noise_floor=args.noise_floor,
            )
        finally:
            progress.close()
        interrupted = len(results) < targets
        if results:
            summaries[tokens] = report.summarize(results)
            rows[tokens] = report.request_rows(results)
        if interrupted or args.workload_file:
            break
    if summaries:
        print("\n" + report.table(summaries))
        print("\nWhere the time went (medians):\n" + report.breakdown_table(summaries))
        print("\nThe hits' recompute by layer (medians):\n" + report.layers_table(summaries))
    report.write_json(args.out, config, summaries, rows, complete=not interrupted)
    print(f"\nresults: {args.out}" + (" (interrupted: partial)" if interrupted else ""))
    if args.plots and summaries:
        written = report.plots(args.plots, summaries)
        print(
            "plots: "
            + (", ".join(map(str, written)) if written else "none (matplotlib is not installed)")
        )
    return 130 if interrupted else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.workload_file:
            workloads.load_file(args.workload_file)  # fail before starting anything
        if args.launch:
            return _launched(args)
        endpoint = Endpoint(args.base_url, args.model)
        endpoint.check()
        return bench(args, endpoint, _sizer(args.tokenizer))
    except (EndpointError, WorkloadError) as exc:
        print(f"semshare-bench: error: {exc}", file=sys.stderr)
        return 2


def _describe(cache: dict[str, str]) -> str:
    if not cache:
        return "cache configuration not reported"
    caching = {"True": "on", "False": "off"}.get(cache.get("enable_prefix_caching", ""), "?")
    return f"prefix caching {caching}, block size {cache.get('block_size', '?')}"


def _sizer(tokenizer: str | None) -> Sizer:
    if not tokenizer:
        return Sizer()
    from transformers import AutoTokenizer

    return Sizer(AutoTokenizer.from_pretrained(tokenizer))


def _launched(args: argparse.Namespace) -> int:
    from semshare_vllm.testbed import models
    from semshare_vllm.testbed.server import SEMSHARE, VllmServer, stop_servers_on_terminate

    model = args.model or str(models.smollm2())
    kv = dict(SEMSHARE)
    if args.extra_config:
        kv["kv_connector_extra_config"] = args.extra_config
    # room for the workloads' instructions and questions (or the file's longest prompt and the
    # output), within the model's own context
    max_model_len = max(4096, max(args.context_tokens) + 512)
    sizer = _sizer(args.tokenizer or model)
    if args.workload_file:
        longest = workloads.longest(workloads.load_file(args.workload_file), sizer)
        max_model_len = max(max_model_len, longest + args.max_tokens + 16)
    limit = models.context_limit(model)
    if limit is not None:
        max_model_len = min(max_model_len, limit)
    log = Path(tempfile.mkdtemp(prefix="semshare-bench-")) / "vllm-serve.log"
    print(f"starting vllm serve {model} with the SemShare connector (log: {log})")
    with (
        stop_servers_on_terminate(),
        VllmServer(
            model,
            kv,
            shlex.split(args.server_args),
            log,
            max_model_len=max_model_len,
            prefix_caching=True,  # vLLM's default; --server-args may turn it off
        ) as server,
    ):
        endpoint = Endpoint(server.url, server.served_name)
        endpoint.check()
        return bench(args, endpoint, sizer)


if __name__ == "__main__":
    sys.exit(main())
