"""A real ``redis-server`` on loopback for tests and benchmarks: started on a free port with
no persistence, stopped by PID; ``stop``/``start`` again simulate an outage."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

from semshare_vllm.testbed.server import free_port


def redis_binary() -> str | None:
    """``redis-server`` (Debian's package; ``make test`` installs it) or ``valkey-server``."""
    return shutil.which("redis-server") or shutil.which("valkey-server")


class RedisServer:
    def __init__(self, port: int | None = None):
        self.binary = redis_binary()
        if self.binary is None:
            raise RuntimeError(
                "no redis-server or valkey-server on PATH (apt install "
                "redis-server; `make test` does)"
            )
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 20) -> "RedisServer":
        self.proc = subprocess.Popen(
            [
                self.binary,
                "--bind",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--save",
                "",
                "--appendonly",
                "no",
                "--protected-mode",
                "yes",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
            if self.ping():
                return self
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server did not answer on port {self.port}")

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
