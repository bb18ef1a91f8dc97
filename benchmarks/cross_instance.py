"""Cross-instance reuse: the ``cross-instruction`` workload split across two ``vllm serve``
instances (SmolLM2-135M, CPU, loopback) that share one real ``redis-server`` as LMCache's remote
backend and as the shared donor index. Every donor is sent to instance A, every target to
instance B, which has never seen the donor's text: a target is a hit only through the shared
index and LMCache. Each target is measured on B cold (connector opted out, fresh salt) and
served, alternating which goes first, like ``semshare-bench``; also the time from A answering
the donor to B having it in its index (capture, LMCache put to Redis, embedding, publish,
B's read).

    .venv/bin/python benchmarks/cross_instance.py --groups 6 --context-tokens 1024 2048
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import tempfile
import time
from pathlib import Path

from semshare_vllm.bench import report, workloads
from semshare_vllm.bench.client import Endpoint
from semshare_vllm.bench.measure import OPT_OUT, measure_target, warm_up
from semshare_vllm.testbed import models
from semshare_vllm.testbed.redis_server import RedisServer
from semshare_vllm.testbed.server import SEMSHARE, VllmServer, stop_servers_on_terminate

# Both instances sign their records and readiness marks with this (shared_index_secret).
SECRET = secrets.token_hex(32)


def shared_config(redis_url: str) -> dict:
    return dict(
        SEMSHARE,
        kv_connector_extra_config={
            "kv_tier": "lmcache",
            "lmcache_remote_url": redis_url,
            "shared_index_url": redis_url,
            "shared_index_secret": SECRET,
            "host_store_bytes": "1GiB",
            "lmcache_local_cpu_bytes": "512MiB",
        },
    )


def wait_shared_in(
    a: Endpoint, b: Endpoint, published_before: float, timeout_s: float = 120
) -> float | None:
    """Seconds until A has announced one more donor and B's index holds every donor A
    announced (None: not within the timeout). Both engines are kept stepping, as
    ``semshare-bench`` does for captures: vLLM does not step an idle engine for a finished
    request's capture, so A's would otherwise wait for A's next request (and B takes records
    in at a step)."""
    t0 = time.monotonic()
    while time.monotonic() < t0 + timeout_s:
        published = a.counters().get("donors_published", 0)
        if published > published_before and b.counters().get("donors_shared_in", 0) >= published:
            return time.monotonic() - t0
        for e in (a, b):
            e.complete("ping", max_tokens=1, kv_transfer_params=OPT_OUT)
        time.sleep(0.1)
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", type=int, default=6)
    p.add_argument("--context-tokens", type=int, nargs="+", default=[1024, 2048])
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--no-perplexity", dest="perplexity", action="store_false")
    args = p.parse_args()

    # Two engines, their pools and Redis share this machine's memory: vLLM's own KV cache needs
    # little at these lengths (SmolLM2: 45 KiB per token).
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    model = str(models.smollm2())
    from transformers import AutoTokenizer

    sizer = workloads.Sizer(AutoTokenizer.from_pretrained(model))
    logs = Path(tempfile.mkdtemp(prefix="semshare-cross-"))
    max_len = max(4096, max(args.context_tokens) + 512)
    print(f"logs: {logs}")
    with (
        RedisServer() as redis,
        VllmServer(
            model,
            shared_config(redis.url),
            ["--block-size", "32"],
            logs / "a.log",
            max_model_len=max_len,
        ) as server_a,
        VllmServer(
            model,
            shared_config(redis.url),
            ["--block-size", "32"],
            logs / "b.log",
            max_model_len=max_len,
        ) as server_b,
    ):
        a = Endpoint(server_a.url, server_a.served_name)
        b = Endpoint(server_b.url, server_b.served_name)
        warm_up(b)
        warm_up(a)
        wait_shared_in(a, b, 0)  # A's warm-up donors reach B before any measurement
        summaries, propagation, fetch = {}, {}, {}
        for tokens in args.context_tokens:
            requests = workloads.build("cross-instruction", args.groups, tokens, sizer)
            results, waits = [], []
            fetch_before = b.counters()
            for group in dict.fromkeys(r.group for r in requests):
                donor = next(r for r in requests if r.group == group and r.role == "donor")
                target = next(r for r in requests if r.group == group and r.role == "target")
                before = a.counters().get("donors_published", 0)
                a.complete(donor.prompt, max_tokens=2)
                waits.append(wait_shared_in(a, b, before))
                m = measure_target(
                    b,
                    target,
                    args.max_tokens,
                    cold_first=len(results) % 2 == 1,
                    perplexity=args.perplexity,
                )
                results.append(m)
                print(
                    f"  {tokens} tokens, {group}: shared after "
                    f"{waits[-1] if waits[-1] is not None else float('nan'):.2f} s, "
                    f"claimed {m.connector_tokens}/{m.prompt_tokens}, TTFT cold "
                    f"{m.cold.ttft_s * 1e3:.0f} ms, served {m.served.ttft_s * 1e3:.0f} ms",
                    flush=True,
                )
            after = b.counters()
            summaries[tokens] = report.summarize(results)
            seen = [w for w in waits if w is not None]
            propagation[tokens] = (
                statistics.median(seen) if seen else None,
                len(waits) - len(seen),
            )
            n = after.get("tier_fetches", 0) - fetch_before.get("tier_fetches", 0)
            fetch[tokens] = (
                n,
                (after.get("tier_fetch_ms", 0) - fetch_before.get("tier_fetch_ms", 0)) / n
                if n
                else None,
            )
        print("\nTargets on instance B, donors served by instance A:\n")
        print(report.table(summaries))
        print(
            "\n| context | donor visible on B (median) | not shared in 120 s | B's fetches from "
            "LMCache+Redis | mean fetch |"
        )
        print("|---|---|---|---|---|")
        for tokens in args.context_tokens:
            med, missing = propagation[tokens]
            n, ms = fetch[tokens]
            print(
                f"| {tokens:,} | {med:.2f} s | {missing} | {n:.0f} | {ms:.0f} ms |"
                if med is not None and ms is not None
                else f"| {tokens:,} | {med} | {missing} | {n:.0f} | {ms} |"
            )


if __name__ == "__main__":
    with stop_servers_on_terminate():  # a killed run stops its servers too
        main()
