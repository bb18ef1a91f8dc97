"""The worker's host-memory donor store, optionally mirrored to a directory.

Holds each donor's KV as one host tensor of pages ``[layers, blocks, kv_heads, block_size, C]``
in the attention backend's own page layout (``layout`` names it), keyed by (namespace, donor id);
files carry the tensor-parallel rank. The scheduler's ``DonorIndex`` decides
what stays (it does the byte accounting); the store also enforces the byte budget itself, dropping
least recently used tensors from memory, so a disagreement can cost a reload or a miss, never
memory. Disk writes run on a background thread, in submission order, so a capture never waits on
the disk; a donor not in memory is read back (and checksum-verified) on first use.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import OrderedDict
from pathlib import Path

import torch

from semshare_vllm import donor_file
from semshare_vllm.metadata import DonorKey

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
        logger.warning("SemShare: host_store_bytes=%d exceeds %.0f%% of available host memory; "
                       "using %d bytes per rank (set VLLM_CPU_KVCACHE_SPACE lower on CPU, or "
                       "host_store_bytes explicitly)", budget, 100 * MAX_AVAILABLE_FRACTION,
                       ceiling)
        return ceiling
    return budget


class DonorUnavailable(RuntimeError):
    """The donor is neither in memory nor readable from disk."""


class HostKVStore:
    def __init__(self, capacity_bytes: int, layer_names: list[str], layout: str = "",
                 tp_rank: int = 0, tp_size: int = 1, persist_root: Path | None = None):
        self.capacity_bytes = capacity_bytes
        self.layer_names = list(layer_names)
        self.layout = layout
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.persist_root = persist_root
        self._mem: OrderedDict[DonorKey, torch.Tensor] = OrderedDict()
        self.used_bytes = 0
        self._lock = threading.Lock()
        self._disk_q: queue.Queue | None = None
        self._writer: threading.Thread | None = None
        if persist_root is not None:
            persist_root.mkdir(parents=True, exist_ok=True)
            self._disk_q = queue.Queue()
            self._writer = threading.Thread(target=self._write_loop, name="semshare-persist",
                                            daemon=True)
            self._writer.start()

    # ---- memory -------------------------------------------------------------------------------
    def put(self, key: DonorKey, token_ids: list[int], kv: torch.Tensor) -> None:
        with self._lock:
            self._insert(key, kv)
        if self._disk_q is not None:
            self._disk_q.put(("write", key, token_ids, kv))

    def get(self, key: DonorKey) -> torch.Tensor:
        """The donor's KV; read from disk if it is not in memory. Raises DonorUnavailable."""
        with self._lock:
            kv = self._mem.get(key)
            if kv is not None:
                self._mem.move_to_end(key)
                return kv
        path = self._path(key)
        if path is None or not path.exists():
            raise DonorUnavailable(f"donor {key.donor_id} is not in the host store")
        try:
            header, kv = donor_file.read(path)
        except donor_file.CorruptDonorFile as exc:
            raise DonorUnavailable(str(exc)) from exc
        if (header.namespace, header.donor_id) != (key.namespace, key.donor_id) or \
                header.layer_names != self.layer_names:
            raise DonorUnavailable(f"{path}: belongs to another donor or model")
        if header.layout != self.layout:
            raise DonorUnavailable(f"{path}: page layout {header.layout}, this engine has "
                                   f"{self.layout}")
        with self._lock:
            self._insert(key, kv)
        return kv

    def drop(self, key: DonorKey) -> None:
        self.drop_memory(key)
        if self._disk_q is not None:
            self._disk_q.put(("delete", key, None, None))

    def drop_memory(self, key: DonorKey) -> None:
        """Free the in-memory copy only; a persisted file stays and is read back on next use."""
        with self._lock:
            kv = self._mem.pop(key, None)
            if kv is not None:
                self.used_bytes -= kv.nbytes

    def __contains__(self, key: DonorKey) -> bool:
        return key in self._mem

    def _insert(self, key: DonorKey, kv: torch.Tensor) -> None:
        old = self._mem.pop(key, None)
        if old is not None:
            self.used_bytes -= old.nbytes
        self._mem[key] = kv
        self.used_bytes += kv.nbytes
        while self.used_bytes > self.capacity_bytes and len(self._mem) > 1:
            _, victim = self._mem.popitem(last=False)
            self.used_bytes -= victim.nbytes

    # ---- disk ---------------------------------------------------------------------------------
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
                kind, key, token_ids, kv = op
                path = self._path(key)
                if kind == "write":
                    donor_file.write(path, key.namespace, key.donor_id, token_ids,
                                     self.layer_names, self.layout, kv)
                else:
                    path.unlink(missing_ok=True)
            except Exception:  # a full or read-only disk must not take the engine down
                logger.exception("SemShare: persisting a donor failed; it stays memory-only")
            finally:
                self._disk_q.task_done()

    def flush(self) -> None:
        """Wait until every queued disk write and delete is done."""
        if self._disk_q is not None:
            self._disk_q.join()

    def close(self) -> None:
        if self._disk_q is not None and self._writer is not None:
            self._disk_q.put(None)
            self._writer.join(timeout=30)
            self._disk_q = None
