"""Two spawned processes that form vLLM's tensor-parallel group of two on CPU (gloo), running
named scenarios from ``tp_ranks`` side by side. A scenario that does not come back from both
ranks within its timeout is a hang (one rank waiting in a collective the other never enters):
both processes are killed, and the next scenario starts a fresh pair."""

from __future__ import annotations

import queue
import socket
import time

import torch.multiprocessing as mp

START_TIMEOUT_S = 180  # importing vLLM twice on two cores


class Hang(AssertionError):
    """The ranks did not both finish: one waits in a collective the other skipped."""


class TPPair:
    def __init__(self):
        self._procs: list = []

    def _start(self) -> None:
        from support import tp_ranks

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = mp.get_context("spawn")  # (vLLM and torch are already imported here)
        self._commands = [ctx.Queue() for _ in range(2)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(
                target=tp_ranks.serve,
                args=(rank, port, self._commands[rank], self._results),
                daemon=True,
            )
            for rank in range(2)
        ]
        for p in self._procs:
            p.start()
        self._collect(START_TIMEOUT_S, "start-up")

    def run(self, scenario: str, timeout_s: float = 60) -> list[dict]:
        """Each rank's result of ``scenario``, in rank order; ``Hang`` past ``timeout_s``."""
        if not self._procs:
            self._start()
        for commands in self._commands:
            commands.put(scenario)
        return self._collect(timeout_s, scenario)

    def _collect(self, timeout_s: float, what: str) -> list[dict]:
        got: dict[int, dict] = {}
        deadline = time.monotonic() + timeout_s
        while len(got) < 2:
            try:
                rank, out = self._results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                self.close(kill=True)
                raise Hang(f"{what}: ranks {sorted(got)} finished, the others hang") from None
            got[rank] = out
        return [got[0], got[1]]

    def close(self, kill: bool = False) -> None:
        if kill:
            for p in self._procs:
                p.kill()
        else:
            for commands in self._commands:
                commands.put(None)
        for p in self._procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        self._procs = []
