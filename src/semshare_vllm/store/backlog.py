"""Bytes waiting for a consumer slower than the captures (the disk's writer, LMCache's puts),
kept under a bound: past it the caller skips the work, so a stalled consumer never grows the
worker's memory until it is killed. Any thread may add, room-check and finish."""

from __future__ import annotations

import threading


class ByteBacklog:
    def __init__(self, limit: int | None):
        self.limit = limit  # None: no bound
        self._queued = 0
        self._lock = threading.Lock()

    @property
    def queued(self) -> int:
        with self._lock:
            return self._queued

    def room(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more may wait (always, when nothing waits)."""
        queued = self.queued
        return self.limit is None or queued == 0 or queued + nbytes <= self.limit

    def add(self, nbytes: int) -> None:
        with self._lock:
            self._queued += nbytes

    def done(self, nbytes: int) -> None:
        with self._lock:
            self._queued -= nbytes
