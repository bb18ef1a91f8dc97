"""Where a semantic hit's time goes, layer by layer, through a real `vllm serve`: per target of a
`semshare-bench` workload, its cold TTFT (opted out, own salt), then the hit's end-to-end time
(non-streamed, one token: the response carries the connector's provenance) with its timings
(`search`, `align`, `load`, `recompute`) and the recompute's time per layer of the model; then
the CPUs each of the server's threads may run on, per process. The server runs vLLM's defaults
(prefix caching on, its default block size), as `semshare-bench --launch` does; `--server-args`
adds `vllm serve` flags.

    .venv/bin/python benchmarks/hit_layers.py [--size 2048] [--workload doc-qa] [--groups 1]
        [--extra-config '{"recompute_error_bound": 0.01}']
        [--server-args "--block-size 32 --no-enable-prefix-caching"]
"""

from __future__ import annotations

import argparse
import collections
import json
import shlex
import tempfile
import time
import uuid
from pathlib import Path

from semshare_vllm.bench.client import Endpoint
from semshare_vllm.bench.measure import OPT_OUT, wait_for_donors
from semshare_vllm.bench.workloads import Sizer, build
from semshare_vllm.testbed import models
from semshare_vllm.testbed.server import SEMSHARE, VllmServer, stop_servers_on_terminate

LAYERS = 30  # SmolLM2-135M's


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=int, default=2048)
    parser.add_argument("--workload", default="doc-qa")
    parser.add_argument("--groups", type=int, default=1)
    parser.add_argument("--extra-config", type=json.loads, default={})
    parser.add_argument("--server-args", default="", help="more vllm serve flags, one string")
    args = parser.parse_args()
    requests = build(args.workload, args.groups, args.size, Sizer(models.smollm2_tokenizer()))
    kv = dict(SEMSHARE, kv_connector_extra_config=args.extra_config)
    log = Path(tempfile.mkdtemp(prefix="hit-layers-")) / "vllm-serve.log"
    with (
        stop_servers_on_terminate(),
        VllmServer(
            models.smollm2(),
            kv,
            shlex.split(args.server_args),
            log,
            max_model_len=8192,
            prefix_caching=True,
        ) as srv,
    ):
        endpoint = Endpoint(srv.url, srv.served_name)
        groups = collections.defaultdict(list)
        for r in requests:
            groups[r.group].append(r)
        for members in groups.values():
            before = endpoint.counters()
            for donor in (r for r in members if r.role == "donor"):
                srv.complete(donor.prompt, max_tokens=2)
            wait_for_donors(endpoint, before, 1, 600)
            for target in (r for r in members if r.role == "target"):
                cold = srv.complete(
                    target.prompt, 1, cache_salt=uuid.uuid4().hex, kv_transfer_params=OPT_OUT
                )
                t0 = time.perf_counter()
                body = srv.completion_body(target.prompt, max_tokens=1)
                hit_ms = (time.perf_counter() - t0) * 1e3
                served = (body.get("kv_transfer_params") or {}).get("semshare_provenance", {})
                layers = served.get("recompute_layers_ms") or []
                print(
                    f"{target.group}: cold TTFT {cold.ttft_s * 1e3:.0f} ms, hit {hit_ms:.0f} ms "
                    f"({served.get('served')}, share {served.get('recompute_share')}), "
                    f"timings {served.get('timings_ms')}"
                )
                per_layer = cold.ttft_s * 1e3 / LAYERS
                print(f"  cold per layer {per_layer:.0f} ms; recompute by layer:")
                print("  " + " ".join(f"{ms:.0f}" for ms in layers))
        print("threads' CPUs per process (count, CPUs; main thread marked *):")
        for name, threads in sorted(srv.thread_cores().items()):
            counts = collections.Counter(
                (("*" if main else "") + ",".join(map(str, sorted(cores))))
                for main, cores in threads
            )
            print(f"  {name}: " + ", ".join(f"{n} on {c}" for c, n in sorted(counts.items())))


if __name__ == "__main__":
    main()
