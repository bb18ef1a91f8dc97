"""Per-request faults are counted in stats and logged once per kind: a donor store that fails for
every request must not flood the server log (later ones go to DEBUG)."""

from __future__ import annotations

import logging
import threading

_seen: set[tuple[str, str]] = set()
_lock = threading.Lock()


def warn_once(logger: logging.Logger, kind: str, msg: str, *args,
              exc_info: BaseException | bool | None = None) -> None:
    """Log ``msg`` at WARNING the first time ``kind`` happens in this process, at DEBUG after."""
    with _lock:
        first = (logger.name, kind) not in _seen
        _seen.add((logger.name, kind))
    if first:
        logger.warning(msg + " (logged once; later ones are counted in the connector stats)",
                       *args, exc_info=exc_info)
    else:
        logger.debug(msg, *args, exc_info=exc_info)
