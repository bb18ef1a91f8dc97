"""Temporary files that are renamed into place once whole, and the ones killed writers left.

Each temporary file's name carries its writer: ``<prefix><pid>.<start>.<boot>@<host>-<random>
<suffix>``, the process's id, its start time (``/proc/<pid>/stat``) and the first characters of
the kernel's boot id. A process starting up removes a file whose writer is provably gone (same
host and boot, and no process of that id and start time: a reused pid is not mistaken for the
writer) and keeps one another instance is writing now into the same directory. A file of
another host or boot, or whose name says nothing, is taken as left behind once it is
``stale_s`` old, and so is every file that old.
"""

from __future__ import annotations

import functools
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
    here = _machine()
    stale = []
    for path in directory.glob(f"{prefix}*{suffix}"):
        writer, _, host = path.name[len(prefix) :].split("-", 1)[0].partition("@")
        pid, _, rest = writer.partition(".")
        start, _, boot = rest.partition(".")
        try:
            if time.time() - path.stat().st_mtime >= stale_s:
                stale.append(path)
            elif (
                (boot, host) == here
                and boot != "0"  # (no /proc: liveness unknown, the age alone decides)
                and pid.isdigit()
                and _start_time(int(pid)) != start
            ):
                stale.append(path)  # its writer is gone (or the pid is another process's now)
        except OSError:  # vanished meanwhile
            continue
    return stale


def _start_time(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks after boot), None if there is no such
    process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22; the name before ")" may hold spaces


@functools.lru_cache(maxsize=1)
def _machine() -> tuple[str, str]:
    """(boot id's first 8 characters, host name without "-", which separates the writer from
    mkstemp's suffix)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip().replace("-", "")[:8]
    except OSError:
        boot = "0"
    return boot, socket.gethostname().replace("-", "_")


def writer_of(pid: int) -> str:
    """The writer part of the names process ``pid`` of this machine gives its files."""
    boot, host = _machine()
    return f"{pid}.{_start_time(pid) or 0}.{boot}@{host}"


def _writer() -> str:
    return writer_of(os.getpid())
