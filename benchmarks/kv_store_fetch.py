"""Donor KV fetch time from each donor store: the built-in host store, LMCache on local CPU, and
LMCache with a real Redis server (read by a second LMCache engine, as another vLLM instance
would; its local copy dropped before each read). SmolLM2-135M's KV geometry (30 layers, 3 KV
heads of 64, fp32, CPU_ATTN pages of 32 tokens); medians of --runs reads of the whole donor.

    .venv/bin/python benchmarks/kv_store_fetch.py --tokens 1024 2048
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from semshare_vllm.core.keys import DonorKey
from semshare_vllm.layout.specs import page_spec
from semshare_vllm.store.host_store import HostKVStore

L, H, D, BS = 30, 3, 64, 32


def timed(fn, runs: int, before=None) -> float:
    out = []
    for _ in range(runs):
        if before is not None:
            before()
        t0 = time.perf_counter()
        got = fn()
        out.append(time.perf_counter() - t0)
        assert got is not None
    return statistics.median(out) * 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048])
    p.add_argument("--runs", type=int, default=7)
    args = p.parse_args()
    from semshare_vllm.store.lmcache_store import LMCacheKVStore
    from semshare_vllm.testbed.redis_server import RedisServer

    need = max(args.tokens) * L * H * 2 * D * 4 * 3
    host = HostKVStore(
        need,
        [f"l{i}" for i in range(L)],
        (H, BS, 2 * D),
        torch.float32,
        page_layout=page_spec("CPU_ATTN", D, "vec"),
    )
    local = LMCacheKVStore(L, H, D, torch.float32, "smollm2-135m", need)
    with RedisServer() as redis:
        writer = LMCacheKVStore(L, H, D, torch.float32, "smollm2-135m", need, redis.url)
        reader = LMCacheKVStore(L, H, D, torch.float32, "smollm2-135m", need, redis.url)
        print("| tokens | MB | host store | LMCache local CPU | LMCache + Redis (other instance) |")
        print("|---|---|---|---|---|")
        for n in args.tokens:
            key = DonorKey("", f"bench-{n}")
            toks = torch.randint(0, 49152, (n,)).tolist()
            rows = torch.randn(L, n, H, 2 * D)
            mb = rows.numel() * 4 / 1e6
            for store in (host, local, writer):
                store.put(key, toks, rows)
            assert torch.equal(reader.get(key, toks), rows)
            keys = [k for _, _, k in reader._keys(key, toks)]

            def drop_local():
                reader.engine.storage_manager.batched_remove(keys, locations=["LocalCPUBackend"])

            ms = [
                timed(lambda: host.get(key, toks), args.runs),
                timed(lambda: local.get(key, toks), args.runs),
                timed(lambda: reader.get(key, toks), args.runs, before=drop_local),
            ]
            print(
                f"| {n} | {mb:.0f} | "
                + " | ".join(f"{m:.1f} ms ({mb / m:.2f} GB/s)" for m in ms)
                + " |",
                flush=True,
            )
        writer.close()
        reader.close()
    local.close()
    host.close()


if __name__ == "__main__":
    main()
