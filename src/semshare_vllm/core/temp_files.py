"""Temporary files that are renamed into place once whole, and the ones killed writers left.

Each temporary file's name carries its writer: ``<prefix><pid>.<start>.<machine>@<host>-
<random><suffix>``: the process's id, its start time (``/proc/<pid>/stat``), and a short hash of
the kernel's boot id and the pid namespace (containers on one machine share the boot and maybe
the host name, not the namespace). A process starting up removes a file whose writer is
provably gone (same machine, namespace and host, and no process of that id and start time: a
reused pid is not mistaken for the writer; a pid /proc hides is taken as alive) and keeps one
another instance is writing now into the same directory. A file of another machine or
namespace, or whose name says nothing (older versions'), is taken as left behind once it is
``stale_s`` old, and so is every file that old (no write takes that long).
"""

from __future__ import annotations

import functools
import hashlib
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
    file is listed only once ``stale_s`` old, so instances sharing a directory do not break
    each other."""
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
                and _gone(int(pid), start)
            ):
                stale.append(path)  # its writer is gone (or the pid is another process's now)
        except OSError:  # vanished meanwhile
            continue
    return stale


def _gone(pid: int, start: str) -> bool:
    """Whether the process ``pid`` that started at ``start`` no longer runs."""
    now = _start_time(pid)
    if now is not None:
        return now != start  # another process has the pid now
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # EPERM: another user's, hidden from /proc (hidepid): alive
        return False
    return False  # there, though /proc does not show it: alive


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
    """(8 hex digits of the boot id and pid namespace, "0" where /proc cannot say; the host
    name without "-", which separates the writer from mkstemp's suffix)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        namespace = os.readlink("/proc/self/ns/pid")
        machine = hashlib.blake2b(f"{boot} {namespace}".encode(), digest_size=4).hexdigest()
    except OSError:
        machine = "0"
    return machine, socket.gethostname().replace("-", "_")


def writer_of(pid: int) -> str:
    """The writer part of the names process ``pid`` of this machine gives its files."""
    boot, host = _machine()
    return f"{pid}.{_start_time(pid) or 0}.{boot}@{host}"


def _writer() -> str:
    return writer_of(os.getpid())
