import os

import pytest
import torch
from support.clock import SteppedClock
from support.safetensors_versions import run_as_version

from semshare_vllm.core.keys import DonorKey
from semshare_vllm.store import donor_file
from semshare_vllm.store.host_store import DonorUnavailable, HostKVStore

LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
PAGE = (2, 4, 16)  # kv_heads, block_size, 2 * head_size


def store(blocks, **kw):
    block_bytes = len(LAYERS) * 2 * 4 * 16 * 4
    return HostKVStore(blocks * block_bytes, LAYERS, PAGE, torch.float32, "CPU_ATTN/vec/8", **kw)


def pages(n, seed=0):
    return torch.randn(len(LAYERS), n, *PAGE, generator=torch.Generator().manual_seed(seed))


def test_pool_is_preallocated_and_lru_evicts():
    s = store(5)
    assert s.pool.shape == (2, 5, *PAGE) and s.used_bytes == 0
    keys = [DonorKey("", f"d{i}") for i in range(3)]
    a = s.allocate(keys[0], 2)
    s.allocate(keys[1], 2)
    s.finish_write(keys[0])
    s.finish_write(keys[1])
    s.blocks(keys[0])  # most recent now
    s.allocate(keys[2], 2)  # needs a victim: keys[1]
    assert keys[0] in s and keys[2] in s and keys[1] not in s
    assert s.blocks(keys[0]) == a
    with pytest.raises(DonorUnavailable):
        s.blocks(keys[1])
    with pytest.raises(DonorUnavailable):
        s.allocate(DonorKey("", "huge"), 6)


def test_a_donor_being_written_is_never_evicted():
    """A donor whose copy is in flight (allocated, its write not finished) is never a victim;
    too big is refused, not half-stored. A write that fails frees its blocks."""
    s = store(5)
    keys = [DonorKey("", f"d{i}") for i in range(2)]
    for key in keys:
        s.allocate(key, 2)
    with pytest.raises(DonorUnavailable):
        s.allocate(DonorKey("", "big"), 4)
    assert keys[0] in s and keys[1] in s
    s.finish_write(keys[0])  # written: now it may go
    s.allocate(DonorKey("", "big"), 3)
    assert keys[0] not in s and keys[1] in s
    s.abort_write(keys[1])
    assert keys[1] not in s and s.used_bytes == 3 * s.block_bytes


def test_persist_roundtrip_and_drop(tmp_path):
    key = DonorKey("tenant", "abc")
    s = store(8, tp_rank=1, tp_size=2, persist_root=tmp_path)
    data = pages(3)
    s.pool[:, s.allocate(key, 3)] = data
    s.persist(key, list(range(12)), data.clone())
    s.flush()
    path = tmp_path / "abc.tp1of2.safetensors"
    assert path.is_file() and not list(tmp_path.glob(".tmp-*"))
    header = donor_file.read_header(path)
    assert (header.namespace, header.token_ids, header.layer_names, header.layout) == (
        "tenant",
        list(range(12)),
        LAYERS,
        "CPU_ATTN/vec/8",
    )
    s.drop_memory(key)
    assert key not in s
    assert torch.equal(s.pool[:, s.blocks(key)], data)  # read back from disk into the pool
    other = HostKVStore(
        s.capacity_bytes,
        LAYERS,
        PAGE,
        torch.float32,
        "FLASH_ATTN/-/8",
        tp_rank=1,
        tp_size=2,
        persist_root=tmp_path,
    )
    with pytest.raises(DonorUnavailable, match="page layout"):
        other.blocks(key)  # pages of another backend are never written into this one
    s.drop(key)
    s.flush()
    assert not path.exists()
    s.close()


def test_after_a_clear_only_the_files_named_are_deleted(tmp_path):
    """A reset clears the store: its donors and their files go, nothing is written or read back
    after. A donor kept in memory after it may share its id (its content) with a file another
    engine wrote into the same directory: dropping it must not delete that file; the donors
    the reset names (``forget_files``) are deleted."""
    s = store(8, persist_root=tmp_path)
    mine, others, named = DonorKey("", "mine"), DonorKey("", "others"), DonorKey("", "named")
    data = pages(2)
    s.pool[:, s.allocate(mine, 2)] = data
    s.persist(mine, list(range(8)), data.clone())
    for key in (others, named):  # written by another engine with the same fingerprint
        donor_file.write(
            tmp_path / f"{key.donor_id}.tp0of1.safetensors",
            "",
            key.donor_id,
            list(range(8)),
            LAYERS,
            "CPU_ATTN/vec/8",
            data,
        )
    s.flush()
    s.clear()
    s.flush()
    assert not (tmp_path / "mine.tp0of1.safetensors").exists()
    with pytest.raises(DonorUnavailable):
        s.blocks(others)  # nothing read back from disk after a clear
    s.pool[:, s.allocate(others, 2)] = data  # the same content, kept in memory only
    s.persist(others, list(range(8)), data.clone())  # not written
    s.drop(others)
    s.forget_files([named])
    s.flush()
    assert (tmp_path / "others.tp0of1.safetensors").exists()
    assert not (tmp_path / "named.tp0of1.safetensors").exists()
    s.close()


def test_truncated_and_corrupted_files_are_detected(tmp_path):
    path = tmp_path / "d.tp0of1.safetensors"
    donor_file.write(path, "", "d", [1, 2, 3], LAYERS, "CPU_ATTN/vec/8", pages(1))
    good = path.read_bytes()
    path.write_bytes(good[: len(good) - 10])
    with pytest.raises(donor_file.CorruptDonorFile, match="header promises"):
        donor_file.read_header(path)
    path.write_bytes(good[:-8] + b"\x00" * 8)
    donor_file.read_header(path)  # same size: the header alone cannot tell...
    with pytest.raises(donor_file.CorruptDonorFile, match="checksum"):
        donor_file.read(path)  # ...the checksum does
    with pytest.raises(DonorUnavailable, match="checksum"):
        store(4, persist_root=tmp_path).blocks(DonorKey("", "d"))
    path.write_bytes(b"garbage")
    with pytest.raises(donor_file.CorruptDonorFile):
        donor_file.read_header(path)


def test_failed_write_leaves_no_partial_file(tmp_path, monkeypatch):
    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(donor_file, "save_file", boom)
    with pytest.raises(OSError):
        donor_file.write(tmp_path / "x.tp0of1.safetensors", "", "x", [1], LAYERS, "L", pages(1))
    assert os.listdir(tmp_path) == []


_REWRITTEN_DONOR = """
from pathlib import Path
import torch
from semshare_vllm.store import donor_file

path = Path(sys.argv[1]) / "d.tp0of1.safetensors"
pages = torch.randn(2, 64, 2, 4, 16)
donor_file.write(path, "", "d", list(range(256)), ["a", "b"], "CPU_ATTN/vec/8", pages)
_, read = donor_file.read(path)
open(path, "wb").close()  # a file copied over it in place (cp, rsync --inplace)
assert torch.equal(read, pages)
print("whole")
"""


@pytest.mark.parametrize("safetensors_version", ["0.8", "before-0.8"])
def test_a_donor_read_is_its_own_memory(tmp_path, safetensors_version):
    """Pages read from a donor file were a view of its memory map: a file rewritten in place
    after its checksum was verified changed the served KV, or, cut short, killed the worker
    with SIGBUS. Run in a child process, as the failure is a signal."""
    rc, out, err = run_as_version(_REWRITTEN_DONOR, tmp_path, safetensors_version)
    assert rc == 0 and out == "whole", (rc, err)


def test_a_disk_slower_than_the_captures_bounds_the_writes_queued(tmp_path, monkeypatch):
    """Each persisted donor was queued as a copy of its pages, without limit: a disk slower than
    the captures grew the worker's memory until it was killed (review: 199 of 200 writes queued,
    +804 MiB beside a 64 MiB pool). Copies past PERSIST_BACKLOG_FRACTION of the store wait for
    none: the donor stays memory-only, and the queue drains once the disk catches up."""
    import threading

    from semshare_vllm.store import host_store

    gate = threading.Event()
    written = []
    write = donor_file.write

    def slow_disk(path, *args):
        gate.wait(timeout=30)
        write(path, *args)
        written.append(path.name)

    monkeypatch.setattr(host_store.donor_file, "write", slow_disk)
    s = store(16, persist_root=tmp_path)
    one = pages(1)
    limit = host_store.PERSIST_BACKLOG_FRACTION * s.capacity_bytes
    queued = 0
    for i in range(16):
        if s.persist_room(s.block_bytes):
            s.persist(DonorKey("", f"d{i}"), [i], one.clone())
            queued += 1
    assert queued == int(limit // s.block_bytes)  # 4 of 16 at a quarter of the store
    gate.set()
    s.flush()
    assert len(written) == queued and s.persist_room(s.capacity_bytes)  # drained, empty again
    s.close()


def test_a_hung_disk_holds_a_load_for_a_bounded_time(tmp_path, monkeypatch):
    """Crash-class review: a donor not in memory was read from ``persist_dir`` on the worker's
    step, synchronously; a hung mount (NFS) held vLLM's step, every request's, for as long as
    it hung. A read now waits ``DISK_READ_TIMEOUT_S`` at most (the load fails: recomputed);
    while that read is stuck, and for ``DISK_RETRY_AFTER_S`` after, the next fail at once
    instead of waiting again."""
    import threading
    import time

    from semshare_vllm.store import host_store

    monkeypatch.setattr(host_store, "DISK_READ_TIMEOUT_S", 0.3, raising=False)
    key, other = DonorKey("tenant", "abc"), DonorKey("tenant", "def")
    s = store(8, persist_root=tmp_path)
    clock = SteppedClock()
    s._disk.clock = clock  # the retry window, stepped instead of slept through
    for k in (key, other):
        s.pool[:, s.allocate(k, 2)] = pages(2)
        s.persist(k, list(range(8)), pages(2))
    s.flush()
    s.drop_memory(key)
    s.drop_memory(other)
    disk = threading.Event()
    real_read = donor_file.read
    calls = []

    def hung_read(path):
        calls.append(path)
        disk.wait(5)  # the mount answers only when the test lets it
        return real_read(path)

    monkeypatch.setattr(donor_file, "read", hung_read)
    try:
        t0 = time.monotonic()
        with pytest.raises(DonorUnavailable, match="did not return within"):
            s.blocks(key)
        with pytest.raises(DonorUnavailable, match="has not returned"):
            s.blocks(other)  # the first read still hangs: no second thread stuck behind it
        assert time.monotonic() - t0 < 4 and len(calls) == 1  # one read, bounded waits
    finally:
        disk.set()
    s._disk._stuck.join(5)  # the hung read returns
    with pytest.raises(DonorUnavailable, match="stalled less than"):
        s.blocks(other)  # a disk that just hung is not waited on again at once
    clock.now += host_store.DISK_RETRY_AFTER_S
    assert torch.equal(s.pool[:, s.blocks(other)], pages(2))  # then reads go on
    assert len(calls) == 2
    s.close()


def test_a_file_not_there_when_a_stalled_read_looked_is_read_once_it_is(tmp_path, monkeypatch):
    """Review of e647fe0: a read that stalled before the donor's file was written (its persist
    still queued behind the slow disk) came back late with "no file", and that answer was kept
    for the donor's next load however much later, after the file had landed: the donor was
    taken as gone (forgotten, its file deleted). "Not there" read late is not kept."""
    import threading

    from semshare_vllm.store import host_store
    from semshare_vllm.store.base import DonorNotReadNow

    monkeypatch.setattr(host_store, "DISK_READ_TIMEOUT_S", 0.05)
    s = store(8, persist_root=tmp_path)
    key = DonorKey("tenant", "abc")
    gate = threading.Event()
    real = host_store._read_back

    def hung(path):
        gate.wait(5)  # the mount hangs
        return real(path)  # no file yet: it is written after

    monkeypatch.setattr(host_store, "_read_back", hung)
    s._disk.clock = clock = SteppedClock()
    with pytest.raises(DonorNotReadNow):
        s.blocks(key)
    gate.set()
    s._disk.running().join(5)
    s.persist(key, list(range(8)), pages(2))  # the write lands
    s.flush()
    clock.now += host_store.DISK_RETRY_AFTER_S
    assert torch.equal(s.pool[:, s.blocks(key)], pages(2))
    s.close()
