"""Temporary files that are renamed into place once whole, and the ones killed writers left.

Each temporary file's name carries its writer (``<prefix><pid>@<host>-<random><suffix>``), so
a process starting up can tell a file a killed writer left (its process is gone from this host:
removed at once) from one another instance is writing now into the same directory (kept).
Another host's file, or one whose name says nothing, is taken as left behind only once it is
``stale_s`` old.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
from pathlib import Path


def create(directory: Path, prefix: str, suffix: str) -> tuple[int, str]:
    """``mkstemp`` in ``directory``, the file's name naming this process as its writer."""
    return tempfile.mkstemp(prefix=f"{prefix}{_writer()}-", suffix=suffix, dir=directory)


def left_behind(directory: Path, prefix: str, suffix: str, stale_s: float) -> list[Path]:
    """The temporary files in ``directory`` whose writer was killed mid-write. A live writer's
    file is never listed, so instances sharing a directory do not break each other."""
    here = _writer().split("@", 1)[1]
    stale = []
    for path in directory.glob(f"{prefix}*{suffix}"):
        pid, _, host = path.name[len(prefix) :].split("-", 1)[0].partition("@")
        try:
            if host == here and pid.isdigit() and int(pid) < 2**31:
                os.kill(int(pid), 0)
                continue  # its writer is alive
            if time.time() - path.stat().st_mtime < stale_s:
                continue
        except ProcessLookupError:
            pass
        except (OSError, ValueError, OverflowError):  # EPERM: alive, another user's; vanished
            continue
        stale.append(path)
    return stale


def _writer() -> str:
    """``pid@host`` (the host name without "-", which separates it from mkstemp's suffix)."""
    return f"{os.getpid()}@{socket.gethostname().replace('-', '_')}"
