"""Reading a persisted donor back, for the worker's step, in a bounded time.

The read runs on a daemon thread and the step waits ``timeout_s`` at most: a hung mount (an NFS
server gone) must not hold vLLM's step, and every request in it, for as long as it hangs. A read
that timed out is left to finish or hang on its own thread (nothing can interrupt it); while it
has not returned, later reads fail at once rather than pile more stuck threads behind it. A
failed read is a ``DonorUnavailable``: the load is recomputed.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

import torch

from semshare_vllm.logs import warn_once
from semshare_vllm.store import donor_file
from semshare_vllm.store.base import DonorUnavailable

logger = logging.getLogger("vllm.semshare.store")


class DiskReader:
    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._stuck: threading.Thread | None = None  # a read that timed out, maybe still hung

    def read(self, path: Path) -> tuple[donor_file.DonorHeader, torch.Tensor]:
        """The file's header and checksum-verified pages. Raises DonorUnavailable."""
        if self._stuck is not None:
            if self._stuck.is_alive():
                raise DonorUnavailable(
                    f"an earlier read of {path.parent} did not return (a hung disk?)"
                )
            self._stuck = None
        result: Future = Future()
        reader = threading.Thread(
            target=_read, args=(path, result), name="semshare-read", daemon=True
        )
        reader.start()
        try:
            return result.result(timeout=self.timeout_s)
        except FutureTimeout:
            self._stuck = reader
            warn_once(
                logger,
                "disk-read",
                "SemShare: reading %s did not return within %.0f s (a hung disk?); its load is "
                "recomputed, and so are the next loads from disk until it returns",
                path,
                self.timeout_s,
            )
            raise DonorUnavailable(
                f"reading {path} did not return within {self.timeout_s:g} s"
            ) from None


def _read(path: Path, result: Future) -> None:
    try:
        if not path.exists():
            raise DonorUnavailable(f"{path} is gone")
        result.set_result(donor_file.read(path))
    except donor_file.CorruptDonorFile as exc:
        result.set_exception(DonorUnavailable(str(exc)))
    except BaseException as exc:  # handed to the waiting step, which counts the load failed
        result.set_exception(exc)
