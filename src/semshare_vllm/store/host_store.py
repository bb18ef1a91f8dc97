"""The worker's host-memory donor store: a preallocated pool of KV pages, optionally mirrored to
a directory.

The pool is one tensor ``[layers, pool_blocks, kv_heads, block_size, C]`` in the attention
backend's own page layout (``layout`` names it). It is allocated and touched once, at start-up,
like vLLM's own KV cache: a capture is then a block gather into pages that are already resident
(page faults on fresh host memory would slow every capture), and pinned on GPU machines so the
copy can run asynchronously. A donor owns a list of pool blocks, keyed by (namespace, donor id).

The scheduler's ``DonorIndex`` decides what stays (it does the byte accounting, against the
capacity this pool reports); the store also evicts least recently used donors itself when the
pool runs out, so a disagreement costs a miss, never memory. Only the engine thread allocates
and frees blocks. Disk writes run on a background thread, in submission order; a donor not in
memory is read back (and checksum-verified) on first use,
waiting ``DISK_READ_TIMEOUT_S`` at most. Files carry the tensor-parallel rank.

The worker reads and writes the pool's blocks directly (``allocate``, ``blocks``): a donor
allocated is being written (its copy in flight on another thread) until ``finish_write`` or
``abort_write``, and is never evicted meanwhile. The ``DonorKVStore`` methods (``put``/``get``,
KV as rows) are what the host store shares with LMCache (``base.py``), through the pool's
``PageOffsets``.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import OrderedDict, deque
from pathlib import Path

import torch

from semshare_vllm.core.keys import DonorKey
from semshare_vllm.core.stall_guard import Stalled, StallGuard
from semshare_vllm.kernels import gather_rearrange, stage_rows
from semshare_vllm.layout.paged_cache import slots_for
from semshare_vllm.layout.specs import PageOffsets, PageSpec
from semshare_vllm.logs import warn_once
from semshare_vllm.store import donor_file
from semshare_vllm.store.backlog import ByteBacklog
from semshare_vllm.store.base import DonorKVStore, DonorNotReadNow, DonorUnavailable

logger = logging.getLogger("vllm.semshare.store")

# Never plan to hold more than this share of the host memory still available when the store is
# set up: on CPU, vLLM sizes its own KV cache to most of RAM (20 GiB of 24 when
# VLLM_CPU_KVCACHE_SPACE is unset), and a worker killed for memory fails every request.
MAX_AVAILABLE_FRACTION = 0.5


def fit_to_memory(budget: int, tp_size: int = 1) -> int:
    """``budget`` (bytes per rank), lowered to fit the host memory available now."""
    import psutil

    ceiling = int(psutil.virtual_memory().available * MAX_AVAILABLE_FRACTION) // max(tp_size, 1)
    if budget > ceiling:
        logger.warning(
            "SemShare: host_store_bytes=%d exceeds %.0f%% of available host memory; "
            "using %d bytes per rank (set VLLM_CPU_KVCACHE_SPACE lower on CPU, or "
            "host_store_bytes explicitly)",
            budget,
            100 * MAX_AVAILABLE_FRACTION,
            ceiling,
        )
        return ceiling
    return budget


# Donor copies queued for the disk may hold at most this share of the host store's bytes, and
# so may rows waiting for LMCache (worker/tier.py): a disk or remote slower than the captures
# would otherwise grow the worker's memory until it is killed.
PERSIST_BACKLOG_FRACTION = 0.25
# How long a load waits for its donor's file to be read back; a 98 MB donor took 176 ms on this
# project's CPU machines. Past it the load is recomputed, and so are the loads from disk of the
# next DISK_RETRY_AFTER_S (``core/stall_guard.py``): a hung mount must not hold vLLM's step.
DISK_READ_TIMEOUT_S = 10.0
DISK_RETRY_AFTER_S = 30.0


class HostKVStore(DonorKVStore):
    name = "host"

    def __init__(
        self,
        capacity_bytes: int,
        layer_names: list[str],
        page_shape: tuple[int, ...],
        dtype: torch.dtype,
        layout: str = "",
        tp_rank: int = 0,
        tp_size: int = 1,
        persist_root: Path | None = None,
        pin_memory: bool = False,
        page_layout: PageSpec | None = None,
    ):
        self.layer_names = list(layer_names)
        self.layout = layout
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.persist_root = persist_root  # None once cleared: no more writes or reads
        self._root = persist_root  # where deletes still go
        itemsize = torch.empty((), dtype=dtype).element_size()
        self.block_bytes = len(layer_names) * itemsize * int(torch.Size(page_shape).numel())
        num_blocks = capacity_bytes // self.block_bytes
        self.pool = torch.empty(
            (len(layer_names), num_blocks, *page_shape), dtype=dtype, pin_memory=pin_memory
        )
        self.pool.zero_()  # touch every page now, not during a capture
        # How rows sit in the pool's pages (the rows API needs it): the pool's own offsets,
        # since its block count and strides are not the cache's.
        self.offsets = None if page_layout is None else page_layout.offsets(self.pool[0])
        self.block_size = page_shape[-2]
        self.capacity_bytes = num_blocks * self.block_bytes
        # donor copies waiting for the disk
        self._backlog = ByteBacklog(int(PERSIST_BACKLOG_FRACTION * self.capacity_bytes))
        self._free: deque[int] = deque(range(num_blocks))
        self._donors: OrderedDict[DonorKey, list[int]] = OrderedDict()  # LRU order
        self._writing: set[DonorKey] = set()  # allocated, their copy in flight: never victims
        self._disk_q: queue.Queue | None = None
        self._writer: threading.Thread | None = None
        self._disk = StallGuard("reading persist_dir", DISK_READ_TIMEOUT_S, DISK_RETRY_AFTER_S)
        if persist_root is not None:
            persist_root.mkdir(parents=True, exist_ok=True)
            self._disk_q = queue.Queue()
            self._writer = threading.Thread(
                target=self._write_loop, name="semshare-persist", daemon=True
            )
            self._writer.start()

    # ---- memory (engine thread only) ----------------------------------------------------------
    def allocate(self, key: DonorKey, num_blocks: int) -> list[int]:
        """Pool blocks for a new donor, which the caller writes: the donor is being written
        (never evicted) until ``finish_write`` or ``abort_write``. Raises DonorUnavailable when
        the pool cannot make room."""
        blocks = self._take_blocks(key, num_blocks)
        self._writing.add(key)
        return blocks

    def finish_write(self, key: DonorKey) -> None:
        """The donor's blocks are written: it may be evicted from now on."""
        self._writing.discard(key)

    def abort_write(self, key: DonorKey) -> None:
        """The donor's write failed: its blocks are freed."""
        self._writing.discard(key)
        self.drop_memory(key)

    def _take_blocks(self, key: DonorKey, num_blocks: int) -> list[int]:
        """Pool blocks for the donor, evicting least recently used donors (never those being
        written) from memory if needed."""
        self.drop_memory(key)
        victims = (k for k in list(self._donors) if k not in self._writing)
        while len(self._free) < num_blocks:
            victim = next(victims, None)
            if victim is None:
                break
            self._release(victim)
        if len(self._free) < num_blocks:
            raise DonorUnavailable(f"donor of {num_blocks} blocks exceeds the host pool")
        blocks = [self._free.popleft() for _ in range(num_blocks)]
        self._donors[key] = blocks
        return blocks

    def blocks(self, key: DonorKey) -> list[int]:
        """The pool blocks holding the donor; read from disk first if it is not in memory."""
        blocks = self._donors.get(key)
        if blocks is not None:
            self._donors.move_to_end(key)
            return blocks
        path = self._path(key)
        if path is None:
            raise DonorUnavailable(f"donor {key.donor_id} is not in the host store")
        try:
            read = self._disk.call(path, _read_back, path)
        except Stalled as exc:
            raise DonorNotReadNow(str(exc)) from exc
        except donor_file.CorruptDonorFile as exc:
            raise DonorUnavailable(str(exc)) from exc
        if read is None:
            raise DonorUnavailable(f"donor {key.donor_id} is not in the host store")
        header, pages = read
        if (header.namespace, header.donor_id) != (
            key.namespace,
            key.donor_id,
        ) or header.layer_names != self.layer_names:
            raise DonorUnavailable(f"{path}: belongs to another donor or model")
        if header.layout != self.layout or pages.shape[2:] != self.pool.shape[2:]:
            raise DonorUnavailable(
                f"{path}: page layout {header.layout}, this engine has {self.layout}"
            )
        blocks = self._take_blocks(key, pages.shape[1])
        if self.pool.is_pinned():  # reused blocks may still feed an asynchronous upload
            torch.cuda.current_stream().synchronize()
        self.pool[:, blocks] = pages
        return blocks

    def drop(self, key: DonorKey) -> None:
        """Forget the donor, in memory and, while this store persists, on disk."""
        self.drop_memory(key)
        if self.persist_root is not None:
            self.forget_files([key])

    def forget_files(self, keys) -> None:
        """Delete the donors' files, also after ``clear`` (a reset names the donors only on
        disk after the worker cleared its store)."""
        if self._disk_q is not None:
            for key in keys:
                self._disk_q.put(("delete", key, None, None, None))

    def clear(self) -> None:
        """A connector reset, or new weights: forget every donor, in memory and on disk, and
        from now on persist nothing and read nothing back (``persist_root`` is None). Later,
        only the files named to ``forget_files`` are deleted: a donor kept in memory after
        this may share its id (its content) with a file another engine wrote."""
        self._writing.clear()
        for key in list(self._donors):
            self.drop(key)
        self.persist_root = None
        self._disk.drop_late()  # a donor read back too late (its pages)

    def drop_memory(self, key: DonorKey) -> None:
        """Free the donor's pool blocks only; a persisted file stays and is read back on use."""
        if key in self._donors:
            self._release(key)

    def _release(self, key: DonorKey) -> None:
        self._free.extend(self._donors.pop(key))

    def __contains__(self, key: DonorKey) -> bool:
        return key in self._donors

    # ---- DonorKVStore: KV as rows (engine thread only) ----------------------------------------
    def put(self, key: DonorKey, token_ids, rows: torch.Tensor) -> bool:
        num = rows.shape[1]
        try:
            blocks = self._take_blocks(key, -(-num // self.block_size))
            gather_rearrange(
                rows,
                torch.arange(num),
                slots_for(blocks, 0, num, self.block_size),
                list(self.pool),
                self._offsets(),
            )
        except DonorUnavailable as exc:
            self.drop_memory(key)
            warn_once(
                logger,
                "put",
                "SemShare: donor %s is not kept in the host store: %s",
                key.donor_id,
                exc,
            )
            return False
        return True

    def get(
        self, key: DonorKey, token_ids, start: int = 0, end: int | None = None
    ) -> torch.Tensor | None:
        end = len(token_ids) if end is None else end
        try:
            blocks = self.blocks(key)
        except DonorUnavailable:
            return None
        if end > len(blocks) * self.block_size:
            return None
        return stage_rows(
            self.pool, slots_for(blocks, start, end, self.block_size), self._offsets()
        )

    def _offsets(self) -> PageOffsets:
        if self.offsets is None:
            raise DonorUnavailable("this host store was made without a page layout")
        return self.offsets

    @property
    def used_bytes(self) -> int:
        return (self.pool.shape[1] - len(self._free)) * self.block_bytes

    # ---- disk (any thread may queue; one writer thread executes in order) ---------------------
    def persist_room(self, nbytes: int) -> bool:
        """Whether a copy of ``nbytes`` may join the writes queued for the disk (one always may
        when none is queued)."""
        return self._backlog.room(nbytes)

    def persist(
        self,
        key: DonorKey,
        token_ids: list[int],
        pages: torch.Tensor,
        num_prompt_tokens: int | None = None,
    ) -> None:
        """Queue a write of the donor's pages (a tensor the caller no longer changes) and of how
        many of its tokens were its prompt (None: all)."""
        if self._disk_q is not None and self.persist_root is not None:
            self._backlog.add(_nbytes(pages))
            self._disk_q.put(("write", key, token_ids, pages, num_prompt_tokens))

    def _path(self, key: DonorKey) -> Path | None:
        if self.persist_root is None:
            return None
        return donor_file.donor_path(self.persist_root, key.donor_id, self.tp_rank, self.tp_size)

    def _write_loop(self) -> None:
        assert self._disk_q is not None
        while True:
            op = self._disk_q.get()
            try:
                if op is None:
                    return
                kind, key, token_ids, pages, num_prompt_tokens = op
                path = donor_file.donor_path(self._root, key.donor_id, self.tp_rank, self.tp_size)
                if kind == "write":
                    donor_file.write(
                        path,
                        key.namespace,
                        key.donor_id,
                        token_ids,
                        self.layer_names,
                        self.layout,
                        pages,
                        num_prompt_tokens,
                    )
                else:
                    path.unlink(missing_ok=True)
            except Exception:  # a full or read-only disk must not take the engine down
                warn_once(
                    logger,
                    "persist",
                    "SemShare: persisting a donor failed; it stays memory-only",
                    exc_info=True,
                )
            finally:
                if op is not None and op[0] == "write":
                    self._backlog.done(_nbytes(op[3]))
                self._disk_q.task_done()

    def flush(self) -> None:
        """Wait until every queued disk write and delete is done."""
        if self._disk_q is not None:
            self._disk_q.join()

    def close(self) -> None:
        self._disk.close()
        if self._disk_q is not None and self._writer is not None:
            self._disk_q.put(None)
            self._writer.join(timeout=30)
            self._disk_q = None


def _read_back(path: Path):
    """(header, pages) of a persisted donor; None when there is no file."""
    if not path.exists():
        return None
    return donor_file.read(path)


def _nbytes(pages: torch.Tensor) -> int:
    return pages.numel() * pages.element_size()
