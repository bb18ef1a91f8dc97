"""A blocking call the caller waits for a bounded time: reading a donor back from a mount that
may hang (NFS), fetching one from a remote that may stop answering (LMCache's Redis).

The call runs on a daemon thread of its own; the caller waits ``timeout_s`` at most. A call
that timed out is left to return or hang on its thread (nothing can interrupt it). While it has
not returned, and for ``retry_after_s`` after it timed out, later calls are refused at once, so
a source that hangs costs the step one wait, not one per request, and never piles up threads.
What a timed-out call returns late is kept (the latest one only) and answers the next call of
the same key at once: a donor slower to read than the wait is then read once, not waited for
on every load.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Callable, Hashable, TypeVar

from semshare_vllm.logs import warn_once

logger = logging.getLogger("vllm.semshare.store")

T = TypeVar("T")


class Stalled(TimeoutError):
    """The call did not return in time, or an earlier one stalled."""


class StallGuard:
    def __init__(self, what: str, timeout_s: float, retry_after_s: float):
        self.what = what  # what the calls do, for messages ("reading persist_dir")
        self.timeout_s, self.retry_after_s = timeout_s, retry_after_s
        self._stuck: threading.Thread | None = None  # the call that timed out, maybe running
        self._late: tuple[Hashable, Future] | None = None  # its key and result
        self._refused_until = 0.0  # monotonic

    def running(self) -> threading.Thread | None:
        """The thread of a call that timed out and has not returned yet, if any."""
        stuck = self._stuck
        return stuck if stuck is not None and stuck.is_alive() else None

    def call(self, key: Hashable, fn: Callable[..., T], *args) -> T:
        """``fn(*args)``'s result, or what it raised; ``Stalled`` past the wait (one caller
        thread: the worker's). ``key`` names what is asked for (a timed-out call's late result
        answers the next call of the same key)."""
        late = self._late
        if late is not None and late[1].done():
            self._late = None
            if late[0] == key:
                return late[1].result()
        if self._stuck is not None and self._stuck.is_alive():
            raise Stalled(f"{self.what}: an earlier call has not returned")
        self._stuck = None
        if time.monotonic() < self._refused_until:
            raise Stalled(f"{self.what}: stalled less than {self.retry_after_s:g} s ago")
        result: Future = Future()
        thread = threading.Thread(
            target=_run, args=(fn, args, result), name="semshare-bounded", daemon=True
        )
        thread.start()
        try:
            return result.result(timeout=self.timeout_s)
        except FutureTimeout:
            self._stuck, self._late = thread, (key, result)
            self._refused_until = time.monotonic() + self.retry_after_s
            warn_once(
                logger,
                f"stalled:{self.what}",
                "SemShare: %s did not return within %g s; its load is recomputed, and so are "
                "those that need it for the next %g s or until it returns",
                self.what,
                self.timeout_s,
                self.retry_after_s,
            )
            raise Stalled(f"{self.what} did not return within {self.timeout_s:g} s") from None


def _run(fn: Callable, args: tuple, result: Future) -> None:
    try:
        result.set_result(fn(*args))
    except BaseException as exc:  # handed to the waiting caller
        result.set_exception(exc)
