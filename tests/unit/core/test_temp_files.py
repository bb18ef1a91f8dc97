"""Which temporary files a process starting up takes as left behind (``core.temp_files``): the
cases the snapshot and donor-file tests do not reach, a pid that /proc hides and a file written
in another pid namespace or machine, or by a version whose names say nothing of their writer."""

import os
import time

from semshare_vllm.core import temp_files

PREFIX, SUFFIX, STALE_S = ".part-", ".tmp", 3600


def planted(directory, writer, tag, age_s=0.0):
    path = directory / f"{PREFIX}{writer}-{tag}{SUFFIX}"
    path.write_bytes(b"half a file")
    if age_s:
        then = time.time() - age_s
        os.utime(path, (then, then))
    return path


def left(directory):
    return sorted(p.name for p in temp_files.left_behind(directory, PREFIX, SUFFIX, STALE_S))


def test_a_writer_that_proc_hides_is_taken_as_alive(tmp_path, monkeypatch):
    """hidepid=2: another user's process has no /proc entry, and signalling it is refused
    (EPERM). It runs: its file is kept, until it is an hour old."""
    hidden = 4_194_305  # above PID_MAX_LIMIT: no real process has it
    monkeypatch.setattr(temp_files, "_start_time", lambda pid: None)

    def kill(pid, sig):
        assert (pid, sig) == (hidden, 0)
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(temp_files.os, "kill", kill)
    boot, host = temp_files._machine()
    fresh = planted(tmp_path, f"{hidden}.12345.{boot}@{host}", "a")
    assert left(tmp_path) == []
    old = planted(tmp_path, f"{hidden}.12345.{boot}@{host}", "b", age_s=2 * STALE_S)
    assert left(tmp_path) == [old.name] and fresh.exists()


def test_another_namespace_or_machine_or_version_is_judged_by_age_alone(tmp_path):
    """A dead pid of another pid namespace (a container beside this one on the same mount),
    another host, or a name without a writer (older versions) proves nothing about its writer:
    kept while younger than ``stale_s``, removed once that old."""
    boot, host = temp_files._machine()
    dead_pid = 4_194_305  # above PID_MAX_LIMIT: no process has it
    names = [
        f"{dead_pid}.1.{'f' * 8 if boot != 'f' * 8 else 'e' * 8}@{host}",  # another namespace
        f"{dead_pid}.1.{boot}@another_host",
        "abcdefgh",  # mkstemp's random part only
    ]
    for i, writer in enumerate(names):
        planted(tmp_path, writer, f"fresh{i}")
    assert left(tmp_path) == []
    old = [planted(tmp_path, w, f"old{i}", age_s=2 * STALE_S).name for i, w in enumerate(names)]
    assert left(tmp_path) == sorted(old)
    # and the same dead pid on this machine and namespace: removed at once
    mine = planted(tmp_path, f"{dead_pid}.1.{boot}@{host}", "mine")
    assert left(tmp_path) == sorted(old + [mine.name])
