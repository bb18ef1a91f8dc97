"""Donor KV in LMCache: the only module that imports LMCache (pinned to 0.5.6, the ``[lmcache]``
extra), so that a version change touches this file alone.

Integration: LMCache's in-process engine (``LMCacheEngine``) used as a store, with a small copy
connector of ours between its memory objects and our rows. Why this one:

* LMCache's own vLLM connectors do not run on vLLM's CPU build, and would have LMCache, not us,
  decide what a request loads (exact prefixes only);
* its multiprocess server moves KV by CUDA IPC, and its public SDK (``lmcache.sdk``) returns only
  prefix hits, staged through host memory: no CPU path, no chunk ranges;
* the engine runs alike on CPU and GPU machines (its storage backends are host-side: local CPU,
  disk, Redis/Valkey, Mooncake, S3, ...), and keys KV as every LMCache deployment does.

Keys: a donor's KV is stored under its own tokens (LMCache's prefix-chained chunk keys, hashed
with ``sha256_cbor``, which is stable across processes), tagged with the donor's namespace
(``lmcache.tag.semshare_ns``: ``namespace_tag``, a hash of it, one-to-one and safe inside
LMCache's key strings) so that two tenants never share a chunk. The last, partial chunk
is stored too. Format: LMCache's ``KV_2LTD`` ``[2, L, T, H*D]`` against our rows
``[L, T, H, 2D]``: one permuted copy each way.

LMCache turns backend failures (Redis down) into misses and logs them itself; its puts to a
remote backend are asynchronous, and ``put`` waits (boundedly) until one is readable.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import logging
import multiprocessing
import os
import tempfile
import time
from typing import Sequence

import torch

from semshare_vllm.core.keys import DonorKey
from semshare_vllm.store.base import DonorKVStore

# Before LMCache is imported: no usage telemetry.
os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")

_PROMETHEUS_DIR = "PROMETHEUS_MULTIPROC_DIR"


@contextlib.contextmanager
def _private_prometheus_dir():
    """LMCache puts its Prometheus files under ``PROMETHEUS_MULTIPROC_DIR``, a fixed directory
    in /tmp shared by every user of the machine where that is unset: a private one, set only
    while LMCache imports and builds an engine (where the process has none of its own). Left
    in the environment, every process started from this one afterwards (a `vllm serve`,
    vLLM's workers) would inherit it, and prometheus_client would sum all their counters into
    each one's /metrics."""
    if os.environ.get(_PROMETHEUS_DIR):
        yield
        return
    os.environ[_PROMETHEUS_DIR] = tempfile.mkdtemp(prefix="semshare-lmc-")
    try:
        yield
    finally:
        os.environ.pop(_PROMETHEUS_DIR, None)


# First, outside it: prometheus_client chooses at import, once per process, whether its metrics
# live in that directory's files, and then reads the variable at each metric it creates.
import prometheus_client  # noqa: E402, F401, I001

with _private_prometheus_dir():
    import lmcache
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
    from lmcache.v1.metadata import LMCacheMetadata

logger = logging.getLogger("vllm.semshare.lmcache")

LMCACHE_VERSION = "0.5.6"
NAMESPACE_TAG = "lmcache.tag.semshare_ns"
_ids = itertools.count()


def namespace_tag(namespace: str) -> str:
    """The namespace's LMCache tag: one per namespace ("" and "-" included), with no character
    LMCache's key strings use as a separator ("@", "%")."""
    return "ns-" + hashlib.blake2b(namespace.encode(), digest_size=16).hexdigest()


class LMCacheKVStore(DonorKVStore):
    name = "lmcache"

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_size: int,
        dtype: torch.dtype,
        model_name: str,
        local_cpu_bytes: int,
        remote_url: str | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        chunk_size: int = 256,
    ):
        version = getattr(lmcache, "__version__", None) or _installed_version()
        if version != LMCACHE_VERSION:
            logger.warning(
                "SemShare: LMCache %s is installed; this adapter was written for %s",
                version,
                LMCACHE_VERSION,
            )
        self.layers, self.heads, self.head_size = num_layers, num_kv_heads, head_size
        self.dtype, self.chunk_size = dtype, chunk_size
        self.remote_url = remote_url or None
        # LMCache's remote puts are asynchronous: ``put`` waits for another instance to be able
        # to read the donor (its index record is published after that), this long plus the
        # donor's transfer at ``put_bytes_per_s``.
        self.put_timeout_s = 5.0
        self.put_bytes_per_s = 100e6
        self._id = f"semshare-{os.getpid()}-{next(_ids)}"
        config = LMCacheEngineConfig.from_defaults(
            chunk_size=chunk_size,
            local_cpu=True,
            max_local_cpu_size=max(local_cpu_bytes, chunk_size) / 2**30,  # GB in LMCache
            save_unfull_chunk=True,
            use_layerwise=False,
            enable_blending=False,
            pre_caching_hash_algorithm="sha256_cbor",
            remote_url=self.remote_url,
            remote_serde="naive",
            lmcache_instance_id=self._id,
        )
        metadata = LMCacheMetadata(
            model_name=model_name,
            world_size=tp_size,
            local_world_size=tp_size,
            worker_id=tp_rank,
            local_worker_id=tp_rank,
            kv_dtype=dtype,
            kv_shape=(num_layers, 2, chunk_size, num_kv_heads, head_size),
            chunk_size=chunk_size,
        )
        # LMCache forces the "spawn" start method on every engine it builds; the process (a vLLM
        # worker) keeps its own.
        start_method = multiprocessing.get_start_method(allow_none=True)
        try:
            with _private_prometheus_dir():
                self.engine = LMCacheEngineBuilder.get_or_create(
                    self._id,
                    config,
                    metadata,
                    _RowsConnector(num_layers, num_kv_heads * head_size),
                    None,
                    None,
                )
                self.engine.post_init()
        finally:
            if multiprocessing.get_start_method(allow_none=True) != start_method:
                multiprocessing.set_start_method(start_method, force=True)
        self._redis = None
        if self.remote_url:
            import redis

            self._redis = redis.Redis.from_url(
                self.remote_url, socket_timeout=2, socket_connect_timeout=2
            )

    # ---- format ----------------------------------------------------------------------------------
    def _to_lmcache(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows [L, T, H, 2D] -> KV_2LTD [2, L, T, H*D] (contiguous, the store's dtype)."""
        L, T, H, _ = rows.shape
        kv = rows.to(self.dtype).view(L, T, H, 2, self.head_size).permute(3, 0, 1, 2, 4)
        return kv.reshape(2, L, T, H * self.head_size)

    def _to_rows(self, kv: torch.Tensor) -> torch.Tensor:
        _, L, T, _ = kv.shape
        rows = kv.view(2, L, T, self.heads, self.head_size).permute(1, 2, 3, 0, 4)
        return rows.reshape(L, T, self.heads, 2 * self.head_size)

    def _keys(self, key: DonorKey, token_ids: Sequence[int]):
        return list(
            self.engine.token_database.process_tokens(
                tokens=list(token_ids),
                request_configs={NAMESPACE_TAG: namespace_tag(key.namespace)},
            )
        )

    # ---- DonorKVStore ------------------------------------------------------------------------
    def put(self, key: DonorKey, token_ids: Sequence[int], rows: torch.Tensor) -> bool:
        if rows.shape[1] != len(token_ids):
            raise ValueError(f"{rows.shape[1]} rows for {len(token_ids)} tokens")
        kv = self._to_lmcache(rows.cpu())
        timeout_s = self.put_timeout_s + kv.numel() * kv.element_size() / self.put_bytes_per_s
        # Twice at most: after the backend restarts, LMCache's first put goes to the connection
        # the server closed and is lost (logged by LMCache); the next one reconnects.
        for _ in range(2):
            self.engine.store(
                tokens=list(token_ids),
                kv=kv,
                request_configs={NAMESPACE_TAG: namespace_tag(key.namespace)},
            )
            state = self._remote_state(key, token_ids, timeout_s)
            if state == "readable":
                return True
            if state == "unreachable":
                break
        logger.warning(
            "SemShare: donor %s is not readable from %s (LMCache logs why); other "
            "instances will miss it",
            key.donor_id,
            self.remote_url,
        )
        return False

    def get(
        self, key: DonorKey, token_ids: Sequence[int], start: int = 0, end: int | None = None
    ) -> torch.Tensor | None:
        end = len(token_ids) if end is None else end
        if not 0 <= start < end <= len(token_ids):
            return None
        manager = self.engine.storage_manager
        parts = []
        for chunk_start, chunk_end, chunk_key in self._keys(key, token_ids):
            if chunk_end <= start or chunk_start >= end:
                continue
            obj = manager.get(chunk_key)  # local CPU first, then the remote backend
            if obj is None:
                return None
            try:
                lo, hi = max(start, chunk_start) - chunk_start, min(end, chunk_end) - chunk_start
                parts.append(obj.tensor[:, :, lo:hi].clone())  # a view into LMCache's arena
            finally:
                obj.ref_count_down()
        return self._to_rows(torch.cat(parts, dim=2)) if parts else None

    def visible(self, key: DonorKey, token_ids: Sequence[int], timeout_s: float = 5.0) -> bool:
        """Wait until the donor's chunks are readable from the remote backend (its puts are
        asynchronous); True at once without one, False at once when it is unreachable."""
        return self._remote_state(key, token_ids, timeout_s) == "readable"

    def _remote_state(self, key: DonorKey, token_ids: Sequence[int], timeout_s: float) -> str:
        """ "readable" (or no remote backend), "unreachable", or "missing" after ``timeout_s``."""
        if self._redis is None:
            return "readable"
        import redis

        names = [k.to_string() + "metadata" for _, _, k in self._keys(key, token_ids)]
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if self._redis.exists(*names) == len(names):
                    return "readable"
            except (redis.RedisError, OSError):
                return "unreachable"
            if time.monotonic() > deadline:
                return "missing"
            time.sleep(0.01)

    def close(self) -> None:
        if self.engine is not None:
            manager = self.engine.storage_manager
            if manager is not None:
                self._close_remote(manager)
            LMCacheEngineBuilder.destroy(self._id)  # its event-loop thread is not a daemon
            self.engine = None
        if self._redis is not None:
            self._redis.close()

    @staticmethod
    def _close_remote(manager) -> None:
        """LMCache 0.5.6: closing its Redis connector deadlocks (on the storage manager's event
        loop, it waits for a shutdown that needs that loop). Do the same from this thread: stop
        its workers (``put`` waited for its puts, which read LMCache's arena that ``destroy``
        frees), close the connection, and leave the backend out of ``destroy``."""
        remote = manager.storage_backends.pop("RemoteBackend", None)
        connector = getattr(getattr(remote, "connection", None), "_connector", None)
        try:
            if connector is not None:
                connector.pq_executor.shutdown(wait=False)  # cancels its workers
                asyncio.run_coroutine_threadsafe(connector.connection.close(), manager.loop).result(
                    timeout=10
                )
        except Exception as exc:
            logger.warning("SemShare: closing LMCache's Redis connection: %s", exc)


def _installed_version() -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version("lmcache")
    except importlib.metadata.PackageNotFoundError:
        return None


class _RowsConnector(GPUConnectorInterface):
    """LMCache's side of a copy: between its chunk objects (KV_2LTD) and the one tensor a
    ``store`` passes as ``kv`` (``[2, L, T, H*D]``, indexed by absolute token position)."""

    def __init__(self, num_layers: int, hidden: int):
        self.layers, self.hidden = num_layers, hidden

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, self.layers, num_tokens, self.hidden])

    def from_gpu(self, memory_obj, start: int, end: int, **kwargs) -> None:
        memory_obj.tensor.copy_(kwargs["kv"][:, :, start:end])

    def to_gpu(self, memory_obj, start: int, end: int, **kwargs) -> None:
        kwargs["kv"][:, :, start:end].copy_(memory_obj.tensor)

    def batched_from_gpu(self, memory_objs, starts, ends, **kwargs) -> None:
        for obj, start, end in zip(memory_objs, starts, ends):
            self.from_gpu(obj, start, end, **kwargs)

    def batched_to_gpu(self, memory_objs=None, starts=None, ends=None, **kwargs) -> None:
        for obj, start, end in zip(memory_objs or [], starts or [], ends or []):
            self.to_gpu(obj, start, end, **kwargs)
