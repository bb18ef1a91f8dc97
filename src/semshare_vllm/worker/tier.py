"""LMCache as the donors' second tier (``kv_tier`` "lmcache"), shared across instances.

Each captured donor is also put there, on a thread of its own, since a remote backend may make
the put wait; with a shared index, that thread then marks the donor's shard readable for other
instances (``catalog.shared_index.KVReadyMarks``). A load whose donor is not in the host store
(another instance's donor, or one the pool let go) fetches it from here into the host store
first. Any client of LMCache's backend could write KV under a donor's keys, so a fetch is used
only if its digest is the one its writer signed.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Callable, TypeVar

import torch

from semshare_vllm.core.counters import StatsRecorder
from semshare_vllm.core.keys import DonorKey
from semshare_vllm.core.stall_guard import Stalled, StallGuard
from semshare_vllm.logs import warn_once
from semshare_vllm.metadata import LoadSpec
from semshare_vllm.store.backlog import ByteBacklog
from semshare_vllm.store.base import DonorKVStore, DonorNotReadNow, DonorUnavailable
from semshare_vllm.store.host_store import HostKVStore
from semshare_vllm.vllm_compat.cpu_binding import connector_thread

logger = logging.getLogger("vllm.semshare.worker")

T = TypeVar("T")


def _cuda_device() -> int | None:
    """The calling worker's CUDA device, where it has one in use."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.current_device()
    return None


def _on_device(device: int | None, fn: Callable[[], T]) -> T:
    """On a thread of ours: use the worker's CUDA device before LMCache is built or read (it
    pins its buffers through the current device; a new thread's is device 0, another rank's
    GPU)."""
    if device is not None:
        torch.cuda.set_device(device)
    return fn()


# Shutdown waits this long at most for the puts in flight (a Redis that answers but does not
# take writes makes each wait LMCache's own timeouts); the rest are dropped.
FLUSH_TIMEOUT_S = 30.0
# A load waits this long at most for its donor from LMCache (which itself waits
# blocking_timeout_secs, 10 by default, per chunk from its remote); past it the load is
# recomputed, and so are the fetches of the next TIER_RETRY_AFTER_S (``core/stall_guard.py``):
# a remote that stopped answering must not hold vLLM's step once per request.
TIER_FETCH_TIMEOUT_S = 10.0
TIER_RETRY_AFTER_S = 30.0


class Tier:
    def __init__(
        self,
        build_store: Callable[[], DonorKVStore],
        stats: StatsRecorder,
        rank: int,
        ready_marks=None,
        backlog_bytes: int | None = None,
    ):
        """``build_store`` makes the store (an ``LMCacheKVStore``); it runs on the tier's
        thread, so that the threads LMCache starts there (its storage manager's event loop,
        which does the remote put, its stats logger, its pin monitor) inherit that thread's
        cores, not the forward pass's. What it raises, this raises."""
        self.stats = stats
        self.rank = rank  # this worker's tensor-parallel rank (its KV shard)
        self.ready_marks = ready_marks  # catalog.shared_index.KVReadyMarks, with a shared index
        # donor -> digest of the KV this rank put (what a fetch back must match)
        self.digests: dict[DonorKey, str] = {}
        # the digest and the put, off the forward pass's cores (as the capture's copy)
        self._thread = connector_thread("semshare-tier")
        self._puts: list[Future] = []
        # rows staged for puts not yet made: at most backlog_bytes (None: no bound)
        self._backlog = ByteBacklog(backlog_bytes)
        self._device = _cuda_device()
        self._fetches = StallGuard(
            "fetching from LMCache", TIER_FETCH_TIMEOUT_S, TIER_RETRY_AFTER_S
        )
        try:
            self.store = self._thread.submit(_on_device, self._device, build_store).result()
        except BaseException:
            self._thread.shutdown(wait=True)
            raise

    # ---- put (after a capture) ----------------------------------------------------------------
    def room(self, nbytes: int) -> bool:
        """Whether rows of ``nbytes`` may join the puts waiting (one always may when none
        waits): a slow or stalled remote must not grow the worker's memory without end."""
        return self._backlog.room(nbytes)

    def put_later(self, key: DonorKey, token_ids: list[int], rows: torch.Tensor) -> None:
        self._backlog.add(rows.numel() * rows.element_size())
        self._puts.append(self._thread.submit(self._put, key, token_ids, rows))

    def _put(self, key: DonorKey, token_ids: list[int], rows: torch.Tensor) -> float | None:
        """On the tier thread: milliseconds to a readable put, or None when it failed."""
        try:
            return self._put_now(key, token_ids, rows)
        finally:
            self._backlog.done(rows.numel() * rows.element_size())

    def _put_now(self, key: DonorKey, token_ids: list[int], rows: torch.Tensor) -> float | None:
        t0 = time.perf_counter()
        try:
            from semshare_vllm.catalog.shared_records import kv_digest

            digest = kv_digest(rows, getattr(self.store, "dtype", None))
            kept = self.store.put(key, token_ids, rows)
            if kept:
                self.digests[key] = digest
            if kept and self.ready_marks is not None:
                # other instances may now load it, if what they fetch is what was put here
                kept = self.ready_marks.mark(key.donor_id, digest)
        except Exception as exc:
            warn_once(
                logger,
                "tier_put",
                "SemShare: putting donor %s in LMCache failed: %s",
                key.donor_id,
                exc,
            )
            kept = False
        return (time.perf_counter() - t0) * 1e3 if kept else None

    def reap(self) -> None:
        """Count the puts done (their stats only: nothing waits for them)."""
        for future in [f for f in self._puts if f.done()]:
            self._puts.remove(future)
            ms = future.result()
            if ms is None:
                self.stats.add("tier_put_failures")
            else:
                self.stats.add("tier_puts")
                self.stats.add("tier_put_ms", ms)

    def forget(self, key: DonorKey) -> None:
        self.digests.pop(key, None)

    # ---- fetch (a load whose donor the host store lacks) --------------------------------------
    def fetch(self, spec: LoadSpec, host: HostKVStore) -> list[int]:
        """Fetch the donor into the host store; its blocks there. Raises DonorUnavailable."""
        t0 = time.perf_counter()
        try:
            rows = self._fetches.call(
                spec.key,
                _on_device,
                self._device,
                lambda: self.store.get(spec.key, spec.donor_token_ids),
            )
        except Stalled as exc:
            raise DonorNotReadNow(str(exc)) from exc
        if rows is None:
            raise DonorUnavailable(
                f"donor {spec.key.donor_id} is in neither the host store nor LMCache"
            )
        self._check_digest(spec, rows)
        if not host.put(spec.key, spec.donor_token_ids, rows):
            raise DonorUnavailable(f"donor {spec.key.donor_id} does not fit the host store")
        self.stats.add("tier_fetches")
        self.stats.add("tier_fetched_tokens", len(spec.donor_token_ids))
        self.stats.add("tier_fetch_ms", (time.perf_counter() - t0) * 1e3)
        return host.blocks(spec.key)

    def _check_digest(self, spec: LoadSpec, rows: torch.Tensor) -> None:
        """Another instance's donor: the digest its rank signed; this instance's: the digest
        this rank recorded when it put it. No digest (nothing to compare with): not used."""
        import hmac

        from semshare_vllm.catalog.shared_records import kv_digest

        if spec.donor_kv_digests is not None:
            digests = spec.donor_kv_digests
            expected = digests[self.rank] if self.rank < len(digests) else ""
        else:
            expected = self.digests.get(spec.key, "")
        got = kv_digest(rows, getattr(self.store, "dtype", None))
        if not hmac.compare_digest(got.encode(), str(expected).encode()):
            self.stats.add("tier_digest_mismatches")
            raise DonorUnavailable(
                f"donor {spec.key.donor_id}: the KV in LMCache is not what "
                "was put there (digest mismatch)"
            )

    # ---- end ----------------------------------------------------------------------------------
    def flush(self, timeout_s: float = FLUSH_TIMEOUT_S) -> bool:
        """Wait for every put in flight, ``timeout_s`` at most: whether they all ended."""
        deadline = time.monotonic() + timeout_s
        for future in list(self._puts):
            try:
                future.result(timeout=max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                logger.warning(
                    "SemShare: LMCache puts still pending after %.0f s; the rest are dropped",
                    timeout_s,
                )
                return False
        return True

    def close(self, cancel: bool = False, wait: bool = True) -> None:
        """``cancel``: puts not started yet are never made (a connector reset). ``wait``
        False: nor is the put running waited for (a flush that timed out: a stalled remote);
        the store is closed once it, and any fetch that timed out, returned."""
        self._thread.shutdown(wait=wait, cancel_futures=cancel)
        self._fetches.close()  # (a stuck fetch stays: running() below)
        put = [f for f in self._puts if not f.done()]
        fetch = self._fetches.running()
        if not put and fetch is None:
            self._close_store()
            return
        # Closing LMCache frees its arena, which a put or fetch still inside it would read:
        # close it once they return (LMCache's own timeouts end them), not holding the caller.
        threading.Thread(  # on the worker's GPU, as LMCache was built (its pinned arena)
            target=_on_device,
            args=(self._device, lambda: self._close_after(put, fetch)),
            name="semshare-tier-close",
            daemon=True,
        ).start()

    def _close_after(self, put: list[Future], fetch: threading.Thread | None) -> None:
        for future in put:
            try:
                future.result()
            except Exception:  # (counted where it ran)
                pass
        if fetch is not None:
            fetch.join()  # (LMCache's own blocking_timeout_secs per chunk ends it)
        try:
            self._close_store()
        except Exception:  # noqa: BLE001  (nobody is left to tell but the log)
            logger.warning("SemShare: closing LMCache failed", exc_info=True)

    def _close_store(self) -> None:
        try:
            self.store.close()
        finally:  # (its Redis connection and thread, whatever LMCache's close raised)
            if self.ready_marks is not None:
                self.ready_marks.close()
