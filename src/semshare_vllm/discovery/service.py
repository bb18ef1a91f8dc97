"""Donor discovery on one background thread, so vLLM's scheduler never waits on a model.

The scheduler half hands work over and picks results up; it never blocks here:

* ``lookup(namespace, token_ids)`` -> a ``Future[Lookup]``: a SimHash scan for near-duplicates
  (no embedding needed), else detokenise -> embed -> cosine top-k in the namespace.
* ``register(key, serial, token_ids)``: embed a new donor; the result waits in ``take_embedded()``
  until the scheduler thread attaches it to the catalog (which owns every mutation).
* ``write_snapshot(entries)``: persist the embeddings (``snapshot.py``).

Lookups jump the queue ahead of registrations, and a long registration lets waiting lookups run
between its batches of windows. The embedder is loaded on the thread as soon as it
starts; if it cannot load, discovery stays off (logged once) and lookups answer "nothing found".
"""

from __future__ import annotations

import collections
import heapq
import itertools
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Hashable

from semshare_vllm.discovery.embedder import DocumentEmbedding, Embedder
from semshare_vllm.discovery.simhash import simhash
from semshare_vllm.discovery.vector_index import Candidate, VectorIndex

logger = logging.getLogger("vllm.semshare.discovery")

# SimHash bits within which two prompts count as near-duplicates (random pairs sit near 32).
NEAR_DUPLICATE_BITS = 6

_LOOKUP, _REGISTER, _OTHER = 0, 1, 2   # queue priorities: lower runs first


@dataclass
class Lookup:
    candidates: list[Candidate]
    embedding: DocumentEmbedding | None   # None when a near-duplicate made it unnecessary
    fingerprint: int
    embed_ms: float = 0.0
    search_ms: float = 0.0
    finished: float = field(default_factory=time.monotonic)   # when the answer was ready


@dataclass
class Embedded:
    key: Hashable
    serial: int
    embedding: DocumentEmbedding
    fingerprint: int
    embed_ms: float


@dataclass(order=True)
class _Job:
    priority: int
    seq: int
    run: Callable[[], None] = field(compare=False)


class DiscoveryService:
    def __init__(self, make_embedder: Callable[[], Embedder], detokenize: Callable[[list], str],
                 index: VectorIndex, *, top_k: int, threshold: float, embedder_id: str):
        self.index = index
        self.embedder_id = embedder_id   # what snapshots are tagged with
        self.top_k = top_k
        self.threshold = threshold
        self._make_embedder = make_embedder
        self._detokenize = detokenize
        self._embedder: Embedder | None = None
        self.failed: str | None = None         # why discovery is off, once it is
        self._jobs: queue.PriorityQueue[_Job] = queue.PriorityQueue()
        self._seq = itertools.count()
        self._embedded: collections.deque[Embedded] = collections.deque()
        self._faults = 0
        self._faults_logged: set[str] = set()
        self._faults_lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="semshare-discovery",
                                        daemon=True)
        self._thread.start()
        self._put(_LOOKUP, self._ready_embedder)  # load the model now, not at the first request

    # ---- called from the scheduler thread -----------------------------------------------------
    def lookup(self, namespace: str, token_ids: list[int]) -> Future:
        future: Future = Future()
        self._put(_LOOKUP, lambda: self._lookup(future, namespace, token_ids))
        return future

    def register(self, key: Hashable, serial: int, token_ids: list[int]) -> None:
        self._put(_REGISTER, lambda: self._register(key, serial, token_ids))

    def write_snapshot(self, write: Callable[[], None]) -> Future:
        future: Future = Future()

        def run():
            try:
                write()
                future.set_result(True)
            except Exception as exc:
                self._fault("snapshot", exc)
                future.set_exception(exc)
        self._put(_OTHER, run)
        return future

    def take_embedded(self) -> list[Embedded]:
        out = []
        while self._embedded:
            out.append(self._embedded.popleft())
        return out

    def take_faults(self) -> int:
        with self._faults_lock:
            n, self._faults = self._faults, 0
        return n

    def close(self, timeout_s: float = 30) -> None:
        self._put(-1, None)
        self._thread.join(timeout_s)

    def wait_idle(self, timeout_s: float = 60) -> bool:
        """Block until every job queued so far has run (tests, shutdown)."""
        done = threading.Event()
        self._put(_OTHER + 1, done.set)
        return done.wait(timeout_s)

    # ---- on the discovery thread --------------------------------------------------------------
    def _put(self, priority: int, run) -> None:
        self._jobs.put(_Job(priority, next(self._seq), run))

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job.run is None:
                return
            try:
                job.run()
            except Exception as exc:  # a job's own handler failed; keep the thread alive
                self._fault("job", exc)

    def _ready_embedder(self) -> Embedder | None:
        if self._embedder is None and self.failed is None:
            try:
                t0 = time.perf_counter()
                self._embedder = self._make_embedder()
                logger.info("SemShare: donor discovery ready (%s, loaded in %.1f s)",
                            self._embedder.name, time.perf_counter() - t0)
            except Exception as exc:
                self.failed = f"{type(exc).__name__}: {exc}"
                logger.warning("SemShare: the embedder could not be loaded, semantic donor "
                               "discovery is off (exact-prefix reuse goes on): %s", self.failed)
        return self._embedder

    def _embed(self, token_ids: list[int], between_batches=None) -> tuple[DocumentEmbedding, float]:
        t0 = time.perf_counter()
        embedding = self._embedder.embed(self._detokenize(token_ids), between_batches)
        return embedding, (time.perf_counter() - t0) * 1e3

    def _run_waiting_lookups(self) -> float:
        """Run the lookups queued meanwhile (a request may be waiting on each) inside a long
        donor embedding; returns the milliseconds they took, which are not the donor's."""
        t0 = time.perf_counter()
        while True:
            with self._jobs.mutex:  # peek: PriorityQueue keeps a heap in .queue
                if not self._jobs.queue or self._jobs.queue[0].priority != _LOOKUP:
                    break
                job = heapq.heappop(self._jobs.queue)
            job.run()
        return (time.perf_counter() - t0) * 1e3

    def _lookup(self, future: Future, namespace: str, token_ids: list[int]) -> None:
        if not future.set_running_or_notify_cancel():
            return  # the request stopped waiting before its turn came
        try:
            fingerprint = simhash(token_ids)
            t0 = time.perf_counter()
            near = self.index.near_duplicates(namespace, fingerprint, NEAR_DUPLICATE_BITS)
            if near:
                future.set_result(Lookup(near[:self.top_k], None, fingerprint,
                                         search_ms=(time.perf_counter() - t0) * 1e3))
                return
            if self._ready_embedder() is None:
                future.set_result(Lookup([], None, fingerprint))
                return
            embedding, embed_ms = self._embed(token_ids)
            t0 = time.perf_counter()
            found = self.index.search(namespace, embedding.vector, self.top_k, self.threshold)
            future.set_result(Lookup(found, embedding, fingerprint, embed_ms,
                                     (time.perf_counter() - t0) * 1e3))
            self.index.build_pending()  # grows a FAISS table when a namespace outgrew exact
        except Exception as exc:
            self._fault("lookup", exc)
            if not future.done():
                future.set_exception(exc)

    def _register(self, key: Hashable, serial: int, token_ids: list[int]) -> None:
        if self._ready_embedder() is None:
            return
        try:
            lent = [0.0]

            def between_batches():
                lent[0] += self._run_waiting_lookups()
            embedding, embed_ms = self._embed(token_ids, between_batches)
            self._embedded.append(Embedded(key, serial, embedding, simhash(token_ids),
                                           embed_ms - lent[0]))
        except Exception as exc:
            self._fault("register", exc)

    def _fault(self, where: str, exc: Exception) -> None:
        with self._faults_lock:
            self._faults += 1
        if where not in self._faults_logged:
            self._faults_logged.add(where)
            logger.warning("SemShare: discovery %s failed (counted; logged once per kind): %s",
                           where, exc, exc_info=exc)


def hf_detokenizer(tokenizer_path: str) -> Callable[[list], str]:
    """Token ids -> text with the served model's own tokenizer (loaded at first use, on the
    discovery thread), so prompts sent as token ids or through a chat template embed alike."""
    state: dict = {}

    def detokenize(token_ids: list) -> str:
        if "tok" not in state:
            from transformers import AutoTokenizer
            state["tok"] = AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True)
        return state["tok"].decode(token_ids, skip_special_tokens=True)
    return detokenize


def build_discovery(config, tokenizer_path: str | None) -> DiscoveryService | None:
    """The discovery service the config asks for (None: ``embedder`` is "none", or the model
    has no tokenizer to turn prompts back into text)."""
    if config.embedder == "none" or not tokenizer_path:
        return None
    from semshare_vllm.discovery.embedder import (
        embedder_identity,
        make_embedder,
        resolve_device,
    )

    device = resolve_device(config.embedder_device)
    index = VectorIndex(kind=config.index_kind, exact_max=config.exact_search_max)
    return DiscoveryService(lambda: make_embedder(config.embedder, device=device),
                            hf_detokenizer(tokenizer_path), index, top_k=config.top_k,
                            threshold=config.similarity_threshold,
                            embedder_id=embedder_identity())
