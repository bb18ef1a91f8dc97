"""The discovery snapshot: round trip, foreign or corrupt files ignored, and a writer killed with
SIGKILL mid-write never leaves a broken snapshot."""

import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from support.snapshot import entries

from semshare_vllm.discovery.snapshot import FILENAME, load_snapshot, write_snapshot


def test_round_trip(tmp_path):
    written = entries(7)
    write_snapshot(tmp_path, written, "emb-1")
    loaded = load_snapshot(tmp_path, "emb-1")
    assert len(loaded) == 7
    for e in written:
        got = loaded[(e.namespace, e.donor_id)]
        assert np.array_equal(got.embedding.vector, e.embedding.vector)
        assert np.array_equal(got.embedding.segments, e.embedding.segments)
        assert got.fingerprint == e.fingerprint
        assert got.embedding.num_tokens == e.embedding.num_tokens
        assert (got.hits, got.deviation_reports, got.demoted) == (
            e.hits,
            e.deviation_reports,
            e.demoted,
        )
        assert got.deviation == e.deviation and got.idle_s == e.idle_s


def test_another_embedder_or_a_corrupt_file_is_ignored(tmp_path):
    write_snapshot(tmp_path, entries(3), "emb-1")
    assert load_snapshot(tmp_path, "emb-2") == {}
    path = tmp_path / FILENAME
    path.write_bytes(path.read_bytes()[:200])
    assert load_snapshot(tmp_path, "emb-1") == {}
    assert load_snapshot(tmp_path / "absent", "emb-1") == {}


TESTS = str(Path(__file__).resolve().parents[2])  # tests/, where support/ is
WRITER = """
import sys
sys.path.insert(0, {tests!r})
from support.snapshot import entries
from semshare_vllm.discovery.snapshot import write_snapshot
n = 1
while True:  # ever larger snapshots, as fast as possible, until killed
    write_snapshot({dir!r}, entries(n), "emb-1")
    print(n, flush=True)
    n = n % 400 + 1
"""


def test_kill_9_during_writes_leaves_a_whole_snapshot(tmp_path):
    script = WRITER.format(tests=TESTS, dir=str(tmp_path))
    rng = np.random.default_rng(0)
    for round_ in range(6):
        proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline()  # at least one snapshot finished
        time.sleep(float(rng.uniform(0.05, 0.6)))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        loaded = load_snapshot(tmp_path, "emb-1")
        n = len(loaded)
        assert n >= 1, f"round {round_}: no snapshot survived"
        expected = entries(n)  # exactly one complete version, never a mix
        assert set(loaded) == {(e.namespace, e.donor_id) for e in expected}
        for e in expected:
            assert np.array_equal(
                loaded[(e.namespace, e.donor_id)].embedding.segments, e.embedding.segments
            )
        assert not list(tmp_path.glob(".discovery.*"))  # strays cleaned at load


def test_a_live_writers_temporary_file_is_left_alone(tmp_path):
    """Instances sharing a directory: one starting up removed the temporary file another was
    writing its snapshot to, whose rename then failed. Only files a killed writer left long ago
    are removed."""
    import os

    from semshare_vllm.discovery import snapshot

    live = tmp_path / f"{snapshot._TMP_PREFIX}live.tmp"
    old = tmp_path / f"{snapshot._TMP_PREFIX}old.tmp"
    live.write_bytes(b"being written")
    old.write_bytes(b"left by a killed writer")
    long_ago = time.time() - 2 * snapshot.STALE_TMP_S
    os.utime(old, (long_ago, long_ago))
    assert load_snapshot(tmp_path, "emb-1") == {}
    assert live.exists() and not old.exists()


def test_a_killed_writers_temporary_file_is_removed_at_the_next_load(tmp_path):
    """CI: a writer killed with SIGKILL mid-write left its temporary file, and the restart right
    after kept it (only files an hour old were removed), so it stayed until the next start-up an
    hour later. The file names its writer (pid, start time, boot): one whose process is gone
    is removed at once, and so is one whose pid another process has now (review: a container
    restarted with the same host name reuses pids), or any file an hour old; a live writer's
    is kept."""
    import os

    from semshare_vllm.core import temp_files
    from semshare_vllm.discovery import snapshot

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    prefix = snapshot._TMP_PREFIX
    killed = tmp_path / f"{prefix}{temp_files.writer_of(dead.pid)}-abc.tmp"
    live = tmp_path / f"{prefix}{temp_files.writer_of(os.getpid())}-def.tmp"
    pid, start, rest = temp_files.writer_of(os.getpid()).split(".", 2)
    reused = tmp_path / f"{prefix}{pid}.{int(start) + 1}.{rest}-ghi.tmp"  # an earlier process
    old = tmp_path / f"{prefix}{temp_files.writer_of(os.getpid())}-jkl.tmp"
    for path in (killed, live, reused, old):
        path.write_bytes(b"part of a snapshot")
    long_ago = time.time() - 2 * snapshot.STALE_TMP_S
    os.utime(old, (long_ago, long_ago))
    assert load_snapshot(tmp_path, "emb-1") == {}
    assert sorted(p.name for p in tmp_path.iterdir()) == [live.name]
