"""``core/file_digest.py``: a file is known by what it holds (not by its name, size or mtime),
read once per version of it, across processes through the cache directory."""

import hashlib
import os
import subprocess
import sys
import time

import pytest

from semshare_vllm.core import file_digest
from semshare_vllm.core.file_digest import digest

TRUSTED = file_digest.versions_are_trusted


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """A cache directory of this test; versions trusted and never racy, whatever file system
    holds tmp_path (the tests of those rules set them back)."""
    monkeypatch.setattr(file_digest, "_cache_root", lambda: tmp_path / "cache" / "file-digests")
    monkeypatch.setattr(file_digest, "versions_are_trusted", lambda path, dev: True)
    monkeypatch.setattr(file_digest, "RACY_S", 0.0)
    file_digest.forget_memo()
    yield
    file_digest.forget_memo()


def rewrite(path, data: bytes, ctime_ns: int) -> None:
    """``data`` written over ``path``, in a later tick of the kernel's clock than ``ctime_ns``
    (coarse on many kernels: a rewrite within one tick is the racy case, tested apart)."""
    path.write_bytes(data)
    while path.stat().st_ctime_ns == ctime_ns:
        time.sleep(0.005)
        path.write_bytes(data)


def write_keeping_stats(path, data: bytes, stats) -> None:
    """Other bytes of the same size, the mtime set back: what a normalising copy leaves."""
    assert len(data) == stats.st_size
    rewrite(path, data, stats.st_ctime_ns)
    os.utime(path, ns=(stats.st_atime_ns, stats.st_mtime_ns))


def test_other_content_with_the_same_name_size_and_mtime_is_another_digest(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"\x01" * 1000)
    stats = path.stat()
    before = digest(path)
    write_keeping_stats(path, b"\x02" * 1000, stats)
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (stats.st_size, stats.st_mtime_ns)
    assert digest(path) != before
    file_digest.forget_memo()  # another process, reading the cache directory
    assert digest(path) != before


def test_the_same_content_elsewhere_or_at_another_time_is_the_same_digest(tmp_path):
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    a.write_bytes(os.urandom(3000))
    b.write_bytes(a.read_bytes())
    os.utime(b, ns=(1, 1))
    assert digest(a) == digest(b)
    link = tmp_path / "link.bin"
    link.symlink_to(a)
    assert digest(link) == digest(a)


def test_the_digest_is_the_sha256_of_the_chunks_sha256s(tmp_path, monkeypatch):
    monkeypatch.setattr(file_digest, "CHUNK", 1000)
    data = os.urandom(2500)
    path = tmp_path / "w.bin"
    path.write_bytes(data)
    leaves = [hashlib.sha256(data[i : i + 1000]).digest() for i in (0, 1000, 2000)]
    assert digest(path) == hashlib.sha256(b"".join(leaves)).hexdigest()
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    leaf = hashlib.sha256(b"").digest()
    assert digest(empty) == hashlib.sha256(leaf).hexdigest()


def test_a_version_is_read_once_then_taken_from_the_cache(tmp_path, monkeypatch):
    path = tmp_path / "w.bin"
    path.write_bytes(os.urandom(2000))
    first = digest(path)
    file_digest.forget_memo()
    monkeypatch.setattr(file_digest, "_chunk", lambda *a: pytest.fail("read again"))
    assert digest(path) == first  # from the cache file
    assert digest(path) == first  # from the memo


def test_another_process_reads_the_digest_this_one_wrote(tmp_path):
    path = tmp_path / "w.bin"
    path.write_bytes(os.urandom(2000))
    here = digest(path)
    root = tmp_path / "cache" / "file-digests"
    code = (
        "import pathlib, sys; from semshare_vllm.core import file_digest as d\n"
        "d._chunk = lambda *a: sys.exit('read again')\n"
        f"d._cache_root = lambda: pathlib.Path({str(root)!r})\n"
        "d.versions_are_trusted = lambda path, dev: True; d.RACY_S = 0\n"
        f"print(d.digest(pathlib.Path({str(path)!r})))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == here


def test_a_corrupt_or_foreign_cache_entry_is_not_believed(tmp_path):
    path = tmp_path / "w.bin"
    path.write_bytes(b"\x05" * 100)
    right = digest(path)
    entries = list((tmp_path / "cache" / "file-digests").glob("*.json"))
    assert len(entries) == 1
    for text in ('{"version": ["other"], "digest": "' + "0" * 64 + '"}', "{half", "[]"):
        entries[0].write_text(text)
        file_digest.forget_memo()
        assert digest(path) == right


def test_without_a_usable_cache_directory_it_is_computed_here(tmp_path, monkeypatch):
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache directory would be")
    monkeypatch.setattr(file_digest, "_cache_root", lambda: blocked / "file-digests")
    path = tmp_path / "w.bin"
    path.write_bytes(b"\x07" * 100)
    assert digest(path) == hashlib.sha256(hashlib.sha256(b"\x07" * 100).digest()).hexdigest()


def test_a_missing_file_or_one_changed_while_read_has_no_digest(tmp_path, monkeypatch):
    assert digest(tmp_path / "absent.bin") is None
    path = tmp_path / "w.bin"
    path.write_bytes(b"\x01" * 100)
    real_chunk = file_digest._chunk
    before = path.stat().st_ctime_ns

    def writer_meanwhile(fd, offset, length):
        out = real_chunk(fd, offset, length)
        rewrite(path, b"\x02" * 100, before)  # a trainer saving over it as we read
        return out

    monkeypatch.setattr(file_digest, "_chunk", writer_meanwhile)
    assert digest(path) is None
    assert not list((tmp_path / "cache" / "file-digests").glob("*.json"))


def test_the_cache_directory_stays_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(file_digest, "KEPT", 4)
    paths = []
    for i in range(6):
        paths.append(tmp_path / f"w{i}.bin")
        paths[-1].write_bytes(bytes([i]) * 10)
        digest(paths[-1])
    root = tmp_path / "cache" / "file-digests"
    assert len(list(root.glob("*.json"))) + len(list(root.glob("*.lock"))) <= 4
    file_digest.forget_memo()
    read = []
    real_chunk = file_digest._chunk
    monkeypatch.setattr(file_digest, "_chunk", lambda *a: read.append(1) or real_chunk(*a))
    assert digest(paths[0]) == hashlib.sha256(hashlib.sha256(b"\x00" * 10).digest()).hexdigest()
    assert read  # its entry was pruned: read again


def test_a_file_system_without_locks_still_gives_the_digest(tmp_path, monkeypatch):
    import fcntl

    def no_locks(*a):
        raise OSError(37, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    path = tmp_path / "w.bin"
    path.write_bytes(b"\x09" * 10)
    assert digest(path) == hashlib.sha256(hashlib.sha256(b"\x09" * 10).digest()).hexdigest()


def test_a_lock_held_elsewhere_is_waited_for_a_bounded_time(tmp_path, monkeypatch):
    monkeypatch.setattr(file_digest, "_LOCK_WAIT_MIN_S", 0.3)
    path = tmp_path / "w.bin"
    path.write_bytes(b"\x03" * 10)
    digest(path)  # (creates the entry and its lock file)
    root = tmp_path / "cache" / "file-digests"
    for entry in root.glob("*.json"):
        entry.unlink()
    file_digest.forget_memo()
    (lock_path,) = root.glob("*.lock")
    code = (
        "import fcntl, sys, time; f = open(sys.argv[1], 'a'); fcntl.flock(f, fcntl.LOCK_EX); "
        "print('held', flush=True); time.sleep(30)"
    )
    holder = subprocess.Popen([sys.executable, "-c", code, str(lock_path)], stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline().strip() == b"held"
        started = time.monotonic()
        assert digest(path) == hashlib.sha256(hashlib.sha256(b"\x03" * 10).digest()).hexdigest()
        waited = time.monotonic() - started
        assert 0.3 <= waited < 10  # waited for it, not for the holder's 30 s
    finally:
        holder.kill()
        holder.wait()


def test_a_fault_other_than_io_gives_no_digest(tmp_path, monkeypatch):
    def refused(*a, **k):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(file_digest, "ThreadPoolExecutor", refused)
    path = tmp_path / "w.bin"
    path.write_bytes(b"\x01")
    assert digest(path) is None


def mountinfo(*lines: str) -> bytes:
    return "".join(line + "\n" for line in lines).encode()


MOUNTS = mountinfo(
    "1 0 8:1 / / rw - ext4 /dev/vda rw",
    "2 1 7:0 / /images/model rw - squashfs /dev/loop0 ro",
    "3 1 8:2 / /models/my\\040disk rw - xfs /dev/vdb rw",
    "4 1 0:40 / /models/img rw - overlay overlay rw,lowerdir=/x",
    "5 1 0:50 / /models/bucket rw - fuse.s3fs s3fs rw",
    "6 1 8:3 / /models/llama rw - ext4 /dev/vdc rw",
    "7 1 7:1 / /models rw - squashfs /dev/loop1 ro",  # mounted later, over llama's parent
)


@pytest.mark.parametrize(
    "path, dev, fs",
    [
        ("/root/.cache/m/model.safetensors", (8, 1), "ext4"),
        ("/images/model/model.safetensors", (7, 0), "squashfs"),
        ("/images/modelx/model.safetensors", (8, 1), "ext4"),  # (not under /images/model)
        ("/models/my disk/model.safetensors", (8, 2), "xfs"),
        ("/models/img/model.safetensors", (0, 40), "overlay"),
        ("/models/bucket/model.safetensors", (0, 50), "fuse.s3fs"),
        ("/models/llama/model.safetensors", (7, 1), "squashfs"),  # the hiding mount's file
        ("/root/x", (0, 99), None),  # a device no mount names (a btrfs subvolume)
    ],
)
def test_the_mount_is_the_one_above_the_path_on_the_files_device(path, dev, fs):
    found = file_digest.mount_of(path, os.makedev(*dev), MOUNTS)
    assert (found and found[0]) == fs


def test_a_mount_point_that_is_not_utf8_is_read(tmp_path):
    text = b"1 0 8:1 / / rw - ext4 /dev/vda rw\n2 1 0:70 / /data/Donn\xe9es rw - tmpfs t rw\n"
    path = os.fsdecode(b"/data/Donn\xe9es/w.bin")
    assert file_digest.mount_of(path, os.makedev(0, 70), text) == ("tmpfs", "t")
    assert file_digest.mount_of("/etc/x", os.makedev(8, 1), text) == ("ext4", "/dev/vda")


def fake_sys_block(tmp_path, devices):
    """A /sys/dev/block of ``{"maj:min": (path under devices/, [slaves])}``."""
    root = tmp_path / "sys"
    (root / "dev" / "block").mkdir(parents=True)
    for number, (where, slaves) in devices.items():
        node = root / "devices" / where
        node.mkdir(parents=True, exist_ok=True)
        (node / "dev").write_text(number)
        (node / "slaves").mkdir(exist_ok=True)
        for slave in slaves:
            (node / "slaves" / slave).symlink_to(root / "devices" / "virtual" / slave)
        (root / "dev" / "block" / number).symlink_to(node)
    return root / "dev" / "block"


@pytest.mark.parametrize(
    "dev, image",
    [
        ("253:0", False),  # a disk
        ("253:1", False),  # its partition
        ("7:0", True),  # a loop device
        ("259:1", True),  # a partition of a loop device (kpartx, losetup -P)
        ("252:0", True),  # dm-verity / LUKS / LVM over a loop device
        ("43:0", True),  # nbd (qemu-nbd)
        ("0:40", False),  # no block device (tmpfs, overlay, NFS)
    ],
)
def test_devices_that_serve_an_image_are_told(tmp_path, dev, image):
    block = fake_sys_block(
        tmp_path,
        {
            "253:0": ("pci/block/vda", []),
            "253:1": ("pci/block/vda/vda1", []),
            "7:0": ("virtual/loop0", []),
            "259:1": ("virtual/loop0/loop0p1", []),
            "252:0": ("virtual/dm-0", ["loop0"]),
            "43:0": ("virtual/nbd0", []),
        },
    )
    major, minor = map(int, dev.split(":"))
    assert file_digest._serves_an_image(os.makedev(major, minor), str(block)) is image


def test_this_machines_root_and_an_unknown_mount():
    st = os.stat("/")
    fs = file_digest.mount_of("/", st.st_dev)
    if fs is not None and fs[0] == "ext4" and os.major(st.st_dev) != 0:  # (this machine's)
        assert TRUSTED("/", st.st_dev) is not file_digest._serves_an_image(st.st_dev)
    assert TRUSTED("/x", os.makedev(0, 12345)) is False


@pytest.mark.parametrize(
    "mount, dev, block, image, trusted",
    [
        (("ext4", "/dev/vda"), (253, 0), True, False, True),
        (("ext4", "/dev/loop0"), (7, 0), True, True, False),  # a loop-mounted image
        (("ext4", "/dev/root"), (8, 1), False, False, False),  # no sysfs: cannot tell
        (("btrfs", "/no/such/source"), (0, 44), True, False, False),  # anonymous, unresolved
        (("tmpfs", "tmpfs"), (0, 30), False, False, True),
        (("nfs4", "server:/export"), (0, 60), False, False, True),
        (("zfs", "pool/models"), (0, 70), False, False, False),  # its vdevs are unseen
        (("squashfs", "/dev/loop1"), (7, 1), True, True, False),
        (("overlay", "overlay"), (0, 40), False, False, False),
    ],
)
def test_which_versions_are_trusted(mount, dev, block, image, trusted, monkeypatch):
    monkeypatch.setattr(file_digest, "mount_of", lambda path, d: mount)
    monkeypatch.setattr(file_digest, "_is_block_device", lambda d: block)
    monkeypatch.setattr(file_digest, "_serves_an_image", lambda d: image)
    assert TRUSTED("/m/model.safetensors", os.makedev(*dev)) is trusted


def test_an_anonymous_device_is_judged_by_its_mounts_source(tmp_path, monkeypatch):
    """btrfs gives its files an anonymous device (0:N): the block device is the mount's
    source, which may be a loop device serving an image."""
    looked_at = []
    monkeypatch.setattr(file_digest, "mount_of", lambda path, d: ("btrfs", "/dev/loop3"))
    monkeypatch.setattr(file_digest, "_source_device", lambda s: os.makedev(7, 3))
    monkeypatch.setattr(file_digest, "_is_block_device", lambda d: looked_at.append(d) or True)
    monkeypatch.setattr(file_digest, "_serves_an_image", lambda d: looked_at.append(d) or True)
    assert TRUSTED("/m/x", os.makedev(0, 44)) is False
    assert looked_at == [os.makedev(7, 3)] * 2  # (the source's device, not the anonymous 0:44)


def test_a_version_written_a_moment_ago_is_kept_nowhere(tmp_path, monkeypatch):
    """A same-size rewrite within one tick of a coarse kernel clock keeps every field of the
    version: one whose ctime is under RACY_S old is read again each time, never cached."""
    monkeypatch.setattr(file_digest, "RACY_S", 3600.0)
    path = tmp_path / "w.bin"
    path.write_bytes(b"\x01" * 10)
    first = digest(path)
    assert not list((tmp_path / "cache").rglob("*.json"))
    read = []
    real_chunk = file_digest._chunk
    monkeypatch.setattr(file_digest, "_chunk", lambda *a: read.append(1) or real_chunk(*a))
    assert digest(path) == first and read  # not from the memo: read again


def test_in_an_image_each_process_reads_the_file_itself(tmp_path, monkeypatch):
    """Two image builds with normalised timestamps can agree on every field of a version: no
    cache entry is written or believed there, so another process reads the content again."""
    path = tmp_path / "w.bin"
    path.write_bytes(b"\x01" * 10)
    right = digest(path)  # (trusted, as the fixture says: an entry is written)
    (entry,) = (tmp_path / "cache" / "file-digests").glob("*.json")
    entry.write_text(entry.read_text().replace(right, "f" * 64))  # as another image's would
    file_digest.forget_memo()
    assert digest(path) == "f" * 64  # trusted here: believed
    monkeypatch.setattr(file_digest, "versions_are_trusted", lambda path, dev: False)
    file_digest.forget_memo()
    assert digest(path) == right  # in an image: read again, the entry not believed
    other = tmp_path / "x.bin"
    other.write_bytes(b"\x02")
    digest(other)
    assert len(list((tmp_path / "cache").rglob("*.json"))) == 1  # and none written
