"""What a file holds: a SHA-256 of its content, read once per version of the file.

Names, sizes and mtimes do not tell two checkpoints apart once copies normalise timestamps
(reproducible image builds, archives, a fine-tune saved over its base at the same size and its
mtime set back): weights and adapters are keyed by content.

Reading a large checkpoint takes seconds to minutes, so a digest is kept per *version* of a
file, its ``(device, inode, size, mtime, ctime)`` as the open file reports them. In this process
it is kept for the process's life. Across processes (restarts, an engine's tensor parallel
workers, which then read the file once between them under a lock) it is kept in a small file
under ``config.cache_dir()/file-digests``, but only where that version says what the file holds:
on a file system whose ctime the kernel sets at every write (``_TRUSTED_FS``), on a device that
is not an image (loop, nbd, or mapped onto one). In an image (squashfs, erofs, ISO, a
loop-mounted ext4, an overlay whose lower layers we cannot see, FUSE) the ctime is whatever the
image recorded, so two builds with normalised timestamps can match in every field: there each
process reads the file itself. Entries also carry the boot (inode numbers and clocks restart).
A version whose ctime is less than ``RACY_S`` old when read is kept nowhere: a same-size rewrite
within one tick of the kernel's clock (coarse on many kernels and file systems) would keep every
field (git's "racily clean" rule).

The digest is a tree: SHA-256 over the SHA-256s of the file's 64 MiB chunks, which several
threads hash at once (hashlib releases the GIL), so it does not depend on how many ran.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

logger = logging.getLogger("vllm.semshare")

CHUNK = 64 << 20  # bytes per leaf of the tree: part of what the digest is (never change it)
_READ = 8 << 20  # bytes read at once (memory per thread)


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


_THREADS = max(1, min(8, _cpus()))
_FORMAT = "sha256-tree-64MiB"  # names the scheme in each cached entry
KEPT = 4096  # cached files (entries and their locks, about 300 bytes each) before pruning
# File systems whose ctime the kernel sets on every local write (a loop-mounted image of one of
# them excepted, below). Network ones (nfs) are trusted too: the server keeps the ctime, and the
# open before the fstat revalidates the client's attributes. Not zfs: its source names a dataset,
# not the devices (or image files) its pool lives on.
_TRUSTED_FS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "tmpfs", "nfs", "nfs4"})
_BLOCK_FS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs"})  # on a block device
_IMAGE_DEVICES = ("loop", "nbd")  # block devices that serve an image file's bytes
RACY_S = 2.0
# Another process hashing the same file: waited for as long as a read of the file at this rate
# would take, within these bounds, before this one reads it itself.
_LOCK_WAIT_MIN_S = 1.0
_LOCK_WAIT_MAX_S = 120.0
_LOCK_WAIT_BYTES_PER_S = 100e6

_memo: dict[tuple, str] = {}  # version key -> digest, this process
_memo_lock = threading.Lock()
_warned: set[str] = set()  # what was logged once in this process


def digest(path: Path) -> str | None:
    """The content digest of ``path`` (links followed); None if it cannot be read."""
    try:
        with open(os.path.realpath(path), "rb", buffering=0) as f:
            key = _version(f)
            with _memo_lock:
                known = _memo.get(key)
            if known is not None:
                return known
            if _recent(key[5]):
                return _compute(f, key)  # (kept nowhere)
            found = _through_cache_file(f, key)
    except OSError:
        return None
    except Exception:  # (threads refused, say): never a fault in a request, just unknown
        _warn_once("compute", "SemShare: cannot compute the digest of %s", path, exc_info=True)
        return None
    with _memo_lock:
        _memo[key] = found
    return found


def _recent(ctime_ns: int) -> bool:
    """Less than ``RACY_S`` old, or in the future (another clock)."""
    return time.time_ns() - ctime_ns < RACY_S * 1e9


def recently_changed(path: Path) -> bool:
    """Whether ``path``'s ctime is ``_recent``: such a version is kept nowhere, so a caller
    asking often should not ask for its digest."""
    try:
        return _recent(os.stat(path).st_ctime_ns)
    except OSError:
        return False


def _version(f) -> tuple:
    st = os.fstat(f.fileno())
    return (f.name, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _through_cache_file(f, key: tuple) -> str:
    """The digest from the cache file of this version, else computed (under the entry's lock,
    so that another process computing it meanwhile is waited for) and written there. Where
    versions do not say what a file holds, or without a usable cache directory, computed here."""
    entry = _entry_path(key) if versions_are_trusted(key[0], key[1]) else None
    if entry is None:
        return _compute(f, key)
    cached = _read_entry(entry, key)
    if cached is not None:
        return cached
    try:
        lock = open(entry.with_suffix(".lock"), "a")  # noqa: SIM115 (held across the compute)
    except OSError:
        return _compute(f, key)
    with lock:
        wait_s = min(_LOCK_WAIT_MAX_S, max(_LOCK_WAIT_MIN_S, key[3] / _LOCK_WAIT_BYTES_PER_S))
        _take(lock, wait_s)
        cached = _read_entry(entry, key)  # another process may have computed it meanwhile
        if cached is not None:
            return cached
        value = _compute(f, key)
        _write_entry(entry, key, value)
        return value


def _take(lock, wait_s: float) -> None:
    """The lock, or after ``wait_s`` none (a process stuck holding it, a file system without
    locks): the file is then read here as well, which only costs time."""
    import fcntl

    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return
            time.sleep(0.05)
        except OSError:
            return


def versions_are_trusted(path: str, dev: int) -> bool:
    """Whether a version of the file at ``path`` (resolved) on device ``dev`` says what it
    holds: the kernel set its ctime (``_TRUSTED_FS``) on a device that is not an image. A disk
    file system's device is the file's own, or (btrfs: an anonymous one) its mount's source."""
    try:
        mount = mount_of(path, dev)
        if mount is None or mount[0] not in _TRUSTED_FS:
            return False
        if mount[0] not in _BLOCK_FS:
            return True  # (tmpfs, nfs: no block device)
        if os.major(dev) == 0:  # anonymous: the source names the block device
            dev = _source_device(mount[1])
        return _is_block_device(dev) and not _serves_an_image(dev)
    except Exception:  # (an unexpected mountinfo, no such source): the file is read here
        return False


def _source_device(source: str) -> int:
    return os.stat(source).st_rdev


def _is_block_device(dev: int, sys_block: str = "/sys/dev/block") -> bool:
    return os.major(dev) != 0 and (Path(sys_block) / f"{os.major(dev)}:{os.minor(dev)}").exists()


def mount_of(path: str, dev: int, mountinfo: bytes | None = None) -> tuple[str, str] | None:
    """``(file system type, source)`` of the mount ``path`` (an absolute, resolved path) is on:
    the longest mount point above it whose device is ``dev`` (a mount hidden under a later one
    over its parent has another device), from ``/proc/self/mountinfo`` (or the text given);
    None where none is found."""
    try:
        text = mountinfo if mountinfo is not None else Path("/proc/self/mountinfo").read_bytes()
    except OSError:
        return None
    want = f"{os.major(dev)}:{os.minor(dev)}"
    best, found = -1, None
    for line in os.fsdecode(text).splitlines():  # (non-UTF-8 mount points: surrogates)
        fields = line.split(" ")
        if " - " not in line or len(fields) < 5 or fields[2] != want:
            continue
        point = _unescape(fields[4])
        after = line.split(" - ", 1)[1].split(" ")
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= best and len(after) >= 2:  # (the last of equals: on top)
            best, found = len(point), (after[0], _unescape(after[1]))
    return found


def _serves_an_image(dev: int, sys_block: str = "/sys/dev/block") -> bool:
    """Whether block device ``dev`` is a loop or nbd device, or is mapped onto one (a
    partition, dm-verity, LUKS or LVM over it). Devices with no block entry (tmpfs, NFS) are
    not."""
    node = Path(sys_block) / f"{os.major(dev)}:{os.minor(dev)}"
    try:
        if not node.exists():
            return False
        seen, todo = set(), [node.resolve()]
        while todo:
            here = todo.pop()
            if here in seen:
                continue
            seen.add(here)
            if here.name.startswith(_IMAGE_DEVICES):
                return True
            parent = here.parent  # a partition's disk
            if (parent / "dev").exists():
                todo.append(parent)
            slaves = here / "slaves"
            if slaves.is_dir():
                todo.extend(s.resolve() for s in slaves.iterdir())
    except OSError:
        return True  # (cannot tell: read the file here)
    return False


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash as octal escapes."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def _cache_root() -> Path:
    from semshare_vllm.config import cache_dir

    return cache_dir() / "file-digests"


def _entry_path(key: tuple) -> Path | None:
    try:
        root = _cache_root()
        root.mkdir(parents=True, exist_ok=True)
    except OSError:
        _warn_once(
            "cache",
            "SemShare: no writable cache directory (SEMSHARE_CACHE_DIR): every process of "
            "every start reads the model's files once more to know their content",
        )
        return None
    name = hashlib.sha256(json.dumps(_entry_version(key)).encode()).hexdigest()[:40]
    return root / f"{name}.json"


def _entry_version(key: tuple) -> list:
    return [_FORMAT, _boot_id(), *key]


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _read_entry(entry: Path, key: tuple) -> str | None:
    """The digest an entry holds, if it is whole and of this very version (else None)."""
    try:
        value = json.loads(entry.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(value, dict) or value.get("version") != _entry_version(key):
        return None
    found = value.get("digest")
    return found if isinstance(found, str) and len(found) == 64 else None


def _write_entry(entry: Path, key: tuple, value: str) -> None:
    tmp = entry.with_name(f"{entry.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps({"version": _entry_version(key), "digest": value}))
        os.replace(tmp, entry)  # whole or absent: a reader never sees half an entry
    except OSError:
        tmp.unlink(missing_ok=True)
        return
    _prune(entry.parent)


def _prune(root: Path) -> None:
    """Past ``KEPT`` files, the least recently written half goes (each version of each file
    read adds an entry and its lock; a later read of a dropped one reads the file again)."""
    try:
        files = [p for p in root.iterdir() if p.suffix in (".json", ".lock", ".tmp")]
        if len(files) <= KEPT:
            return
        files.sort(key=lambda p: p.stat().st_mtime_ns)
        for old in files[: len(files) // 2]:
            old.unlink(missing_ok=True)
    except OSError:  # another process pruning at the same time
        pass


def _compute(f, key: tuple) -> str:
    """SHA-256 of the chunks' SHA-256s, all read through the one open file. It must still be
    the version ``key`` names once read (else it changed while we read it: OSError, the caller
    treats it as unreadable)."""
    size, fd = key[3], f.fileno()
    offsets = list(range(0, size, CHUNK)) or [0]
    with ThreadPoolExecutor(min(_THREADS, len(offsets))) as pool:
        leaves = list(pool.map(lambda at: _chunk(fd, at, min(CHUNK, size - at)), offsets))
    if _version(f) != key:
        raise OSError(f"{key[0]} changed while its digest was computed")
    root = hashlib.sha256()
    for leaf in leaves:
        root.update(leaf)
    return root.hexdigest()


def _chunk(fd: int, offset: int, length: int) -> bytes:
    h = hashlib.sha256()
    while length > 0:
        data = os.pread(fd, min(_READ, length), offset)
        if not data:
            raise OSError("the file ended early")
        h.update(data)
        offset += len(data)
        length -= len(data)
    return h.digest()


def _warn_once(kind: str, msg: str, *args, exc_info: bool = False) -> None:
    with _memo_lock:
        first = kind not in _warned
        _warned.add(kind)
    if first:
        logger.warning(msg + " (logged once)", *args, exc_info=exc_info)


def forget_memo() -> None:
    """Drop this process's memo (tests: stand in for another process)."""
    with _memo_lock:
        _memo.clear()
