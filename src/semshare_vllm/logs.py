"""Faults are counted in stats and logged once per kind: a donor store that fails for every
request must not flood the server log (later ones go to DEBUG).

``guarded`` is the one guard at the vLLM callback boundary: a fault inside a connector callback
is counted as a fallback, logged once, and answered with the callback's neutral value, so that
the request is computed as usual. Inner steps that fail for an expected reason (a donor missing,
a store full) use ``warn_once`` and their own counter.
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Any, Callable, TypeVar

_seen: set[tuple[str, str]] = set()
_lock = threading.Lock()

F = TypeVar("F", bound=Callable[..., Any])


def warn_once(
    logger: logging.Logger, kind: str, msg: str, *args, exc_info: BaseException | bool | None = None
) -> None:
    """Log ``msg`` at WARNING the first time ``kind`` happens in this process, at DEBUG after."""
    with _lock:
        first = (logger.name, kind) not in _seen
        _seen.add((logger.name, kind))
    if first:
        logger.warning(
            msg + " (logged once; later ones are counted in the connector stats)",
            *args,
            exc_info=exc_info,
        )
    else:
        logger.debug(msg, *args, exc_info=exc_info)


def guarded(
    where: str, fallback: Any = None, *, counter: str = "fallbacks", on_fault: str | None = None
) -> Callable[[F], F]:
    """Wrap a method of an object with ``stats`` and ``logger`` attributes: an exception is
    counted (``counter``), logged once (with its traceback) and answered with ``fallback``.
    ``on_fault`` names a method called with the same arguments first, for what must still
    happen after a fault (e.g. reporting blocks vLLM already counts as loaded)."""

    def wrap(method: F) -> F:
        @functools.wraps(method)
        def call(self, *args, **kwargs):
            try:
                return method(self, *args, **kwargs)
            except Exception:
                self.stats.add(counter)
                warn_once(
                    self.logger,
                    f"fault:{where}",
                    "SemShare: %s failed; the request is computed as usual",
                    where,
                    exc_info=True,
                )
                if on_fault is not None:
                    getattr(self, on_fault)(*args, **kwargs)
                return fallback

        return call  # type: ignore[return-value]

    return wrap
