"""Donor discovery on background threads, so vLLM's scheduler never waits on a model.

The scheduler half hands work over and picks results up; it never blocks here:

* ``lookup(namespace, token_ids)`` -> a ``Future[Lookup]``: a SimHash scan for near-duplicates;
  then the donors sharing the prompt's token 4-grams (``ngrams.py``): none with enough -> no
  donor; some holding at least half -> they are the candidates (no embedding needed either);
  else, if the prompt can be embedded before its deadline (``EmbedSpeed``; a long prompt with
  no recent estimate is measured on its first tokens first), detokenise ->
  embed -> cosine top-k in the namespace, and if not, no donor. Lookups run on their own
  thread at normal priority: a request is waiting for each.
* ``register(key, serial, tokens_of)``: embed a new donor; the result waits in
  ``take_embedded()`` until the scheduler thread attaches it to the catalog (which owns every
  mutation). Donor work waits in a bounded backlog (``BACKLOG_JOBS``, ``BACKLOG_TOKENS``: the
  oldest is dropped past it), embeddings newest first.
* ``run(job)`` / ``run_background(job)``: other work on the lookup / background thread (the
  latter ahead of the donors' embeddings).
* ``write_snapshot(write)``: persist the embeddings (``snapshot.py``).

A job that fails counts one ``discovery_faults`` in ``stats`` (the scheduler half's
``StatsRecorder``, handed in) and is logged once per kind.

Registrations and snapshots run on a second thread at a lower CPU priority (nice +10): nothing
waits for them, so on a busy CPU they yield to vLLM's own threads. The embedder is loaded as
soon as the service starts; if it cannot load, discovery stays off (logged once) and lookups
answer "nothing found".
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Hashable

from semshare_vllm.core.counters import StatsRecorder
from semshare_vllm.discovery.embedder import DocumentEmbedding, Embedder
from semshare_vllm.discovery.ngrams import sample_grams
from semshare_vllm.discovery.simhash import simhash
from semshare_vllm.discovery.vector_index import Candidate, VectorIndex
from semshare_vllm.logs import warn_once
from semshare_vllm.vllm_compat.cpu_binding import run_on_connector_cores

logger = logging.getLogger("vllm.semshare.discovery")

# SimHash bits within which two prompts count as near-duplicates (random pairs sit near 32).
NEAR_DUPLICATE_BITS = 6
# Share of a prompt's sampled token 4-grams one donor must hold to be a candidate without an
# embedding (the alignment then measures the same-token coverage a hit needs exactly).
GRAM_MATCH_SHARE = 0.5
# Niceness added to the background (donor embedding) thread: under CPU contention it gets about
# a tenth of the share of a normal thread, so vLLM's scheduler and API server go first.
BACKGROUND_NICE = 10
# Donor work (embeddings, alignment features) queued for the background thread. Donors can
# arrive faster than they are embedded (4K tokens took 5-13 s on a busy 2-core CPU), so the
# queue is bounded: past BACKLOG_JOBS pieces of work, or past BACKLOG_TOKENS tokens that only
# the queue holds (a job mostly reads its donor's tokens from the catalog's record, which it
# does not keep alive), the oldest queued work is dropped, counted as
# discovery_backlog_skipped. A dropped donor is still found by its text (its token 4-grams).
# A restore's burst (every persisted donor embedded again) fits far below these.
BACKLOG_JOBS = 1 << 16
BACKLOG_TOKENS = 1 << 20


@dataclass
class Lookup:
    candidates: list[Candidate]
    embedding: DocumentEmbedding | None  # None when SimHash or shared grams answered
    fingerprint: int
    embed_ms: float = 0.0
    no_shared_grams: bool = False  # answered without embedding: no donor shares grams
    too_long_to_embed: bool = False  # answered without embedding: it would miss its deadline


@dataclass
class Embedded:
    key: Hashable
    serial: int
    embedding: DocumentEmbedding
    fingerprint: int
    embed_ms: float


class EmbedSpeed:
    """How long a lookup's embedding takes per token, measured on the lookup thread's own
    embeddings (donors are embedded at a lower priority, slower under load): whether a prompt
    can be embedded before its lookup's deadline. Embedding grows with the prompt (8K
    tokens took 1.6 s on one CPU thread), so past some length a lookup's embedding only keeps
    the thread from the next lookup while its request has long gone on without it."""

    MIN_TOKENS = 256  # shorter embeddings measure the fixed costs more than the rate
    # A prompt longer than this is not embedded blind: with no recent estimate, its first
    # PROBE_TOKENS are embedded to measure the rate (about a quarter of the default deadline).
    PROBE_TOKENS = MIN_TOKENS
    WEIGHT = 0.3  # of the newest measurement in the running estimate
    # A slow spell (a busy core) must not refuse long prompts for good: nothing refused is
    # measured, so an estimate this old is measured again (a probe).
    REMEASURE_S = 60.0

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.ms_per_token: float | None = None  # None: not measured yet (then: try)
        self._clock = clock
        self._measured_at = 0.0

    def observe(self, tokens: int, ms: float) -> None:
        if tokens < self.MIN_TOKENS:
            return
        rate = ms / tokens
        old = self.ms_per_token
        self.ms_per_token = rate if old is None else old + self.WEIGHT * (rate - old)
        self._measured_at = self._clock()

    def due(self) -> bool:
        """Whether the estimate is missing or old enough to be measured again."""
        return self.ms_per_token is None or self._clock() - self._measured_at >= self.REMEASURE_S

    def in_time(self, tokens: int, deadline_ms: float) -> bool:
        """Whether a prompt of ``tokens`` would be embedded by ``deadline_ms`` (unmeasured:
        yes; the caller probes long prompts first)."""
        return self.ms_per_token is None or self.ms_per_token * tokens <= deadline_ms


class _JobThread:
    """One thread running the callables put to it, in order."""

    def __init__(self, name: str, nice: int, on_fault: Callable[[str, Exception], None]):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._on_fault = on_fault
        self._thread = threading.Thread(target=self._loop, args=(nice,), name=name, daemon=True)
        self._thread.start()

    def put(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)

    def drained(self) -> threading.Event:
        """An event set once every job put so far has run."""
        done = threading.Event()
        self.put(done.set)
        return done

    def close(self, timeout_s: float) -> None:
        self._jobs.put(None)
        self._thread.join(timeout_s)

    def _loop(self, nice: int) -> None:
        run_on_connector_cores()  # off vLLM-CPU's compute cores (a no-op elsewhere)
        if nice:
            try:  # Linux: PRIO_PROCESS with a thread id sets that thread's niceness only
                tid = threading.get_native_id()
                os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + nice)
            except (AttributeError, OSError):
                pass
        while (job := self._jobs.get()) is not None:
            try:
                job()
            except Exception as exc:  # a job's own handler failed; keep the thread alive
                self._on_fault("job", exc)


class _Queued:
    """One piece of donor work waiting in the backlog; ``job`` is None once run or dropped
    (which frees what it holds: the donor's tokens)."""

    __slots__ = ("job", "tokens", "on_drop")

    def __init__(self, job: Callable[[], None], tokens: int, on_drop: Callable[[], object] | None):
        self.job, self.tokens, self.on_drop = job, tokens, on_drop


class _DonorBacklog:
    """The donor work queued for the background thread: at most ``BACKLOG_JOBS`` pieces, holding
    at most ``BACKLOG_TOKENS`` tokens of their own; adding past either drops the oldest
    embedding (never the piece just added). Quick pieces (a donor's alignment features, a tenth
    of a second) run first, in order; then embeddings (seconds each), newest first: under a
    burst a new donor, the likeliest to be asked for next (the next turn of a chat), is not
    embedded after every donor before it, and each donor is findable by its text meanwhile."""

    def __init__(self, on_drop: Callable[[], None]):
        self._lock = threading.Lock()
        self._quick: collections.deque[_Queued] = collections.deque()
        self._queued: collections.deque[_Queued] = collections.deque()  # oldest on the left
        self._tokens = 0
        self._on_drop = on_drop

    def add(
        self,
        job: Callable[[], None],
        tokens: int,
        on_drop: Callable[[], object] | None = None,
        quick: bool = False,
    ) -> _Queued:
        """Queue ``job``; one ``run_next`` must be put to the background thread for it."""
        item = _Queued(job, tokens, on_drop)
        dropped = []
        with self._lock:
            (self._quick if quick else self._queued).append(item)
            self._tokens += tokens
            while self._tokens > BACKLOG_TOKENS or len(self) > BACKLOG_JOBS:
                pool = self._queued if self._queued and self._queued[0] is not item else None
                if pool is None:
                    pool = self._quick if self._quick and self._quick[0] is not item else None
                if pool is None:
                    break  # only the piece just added is left
                old = pool.popleft()
                self._tokens -= old.tokens
                # taken under the lock (its on_drop may hold the donor: let go here)
                dropped.append(old.on_drop)
                old.job = old.on_drop = None
        for on_drop in dropped:
            if on_drop is not None:
                on_drop()
            self._on_drop()
        return item

    def __len__(self) -> int:
        return len(self._quick) + len(self._queued)

    def run_next(self) -> None:
        """Run the next piece, if any is left (background thread; dropped ones are gone)."""
        with self._lock:
            if self._quick:
                item = self._quick.popleft()
            elif self._queued:
                item = self._queued.pop()
            else:
                return
            job, item.job, item.on_drop = item.job, None, None
            self._tokens -= item.tokens
        if job is not None:
            job()


class DiscoveryService:
    def __init__(
        self,
        make_embedder: Callable[[], Embedder],
        detokenize: Callable[[list], str],
        index: VectorIndex,
        *,
        top_k: int,
        threshold: float,
        embedder_id: str,
        min_shared_grams: float = 0.0,
        gram_match_share: float = GRAM_MATCH_SHARE,
        deadline_ms: float | None = None,
        stats: StatsRecorder | None = None,
    ):
        """``deadline_ms``: how long a request waits for its lookup (None: embed whatever the
        length); ``stats``: the recorder faults are counted into, from the discovery threads."""
        self.index = index
        self.embedder_id = embedder_id  # what snapshots are tagged with
        self.top_k = top_k
        self.threshold = threshold
        self.min_shared_grams = min_shared_grams
        self.gram_match_share = gram_match_share
        self.deadline_ms = deadline_ms
        self.embed_speed = EmbedSpeed()
        self._make_embedder = make_embedder
        self._detokenize = detokenize
        self._embedder: Embedder | None = None
        self._embedder_lock = threading.Lock()
        self.failed: str | None = None  # why discovery is off, once it is
        self._embedded: collections.deque[Embedded] = collections.deque()
        self.stats = StatsRecorder() if stats is None else stats
        self._registering = True
        self._urgent = _JobThread("semshare-lookup", 0, self._fault)
        self._background = _JobThread("semshare-embed", BACKGROUND_NICE, self._fault)
        self._backlog = _DonorBacklog(self._backlog_full)
        self._urgent.put(self._ready_embedder)  # load the model now, not at the first request

    # ---- called from the scheduler thread -----------------------------------------------------
    def lookup(self, namespace: str, token_ids: list[int]) -> Future:
        future: Future = Future()
        asked = time.monotonic()  # its request's deadline runs from about now
        self._urgent.put(lambda: self._lookup(future, namespace, token_ids, asked))
        return future

    def run(self, job: Callable[[], object]) -> Future:
        """Run ``job`` on the lookup thread (request-path work the scheduler must not do
        itself, such as aligning a request to its candidate donors)."""
        return self._put(self._urgent, job)

    def run_background(self, job: Callable[[], object], holds_tokens: int = 0) -> Future:
        """Run ``job`` on the background thread, ahead of the donors queued for embedding
        (quick work nothing waits for, such as a donor's alignment features; ``holds_tokens``:
        the tokens only it keeps alive); dropped (cancelled) once registrations stop, or when
        the backlog is full."""
        return self._put(
            self._background, job, while_registering=True, tokens=holds_tokens, quick=True
        )

    def _put(
        self,
        thread: _JobThread,
        job: Callable[[], object],
        while_registering: bool = False,
        tokens: int | None = None,
        quick: bool = False,
    ) -> Future:
        """``tokens`` (not None): donor work holding that many tokens, queued through the
        bounded backlog (``quick``: ahead of the embeddings)."""
        future: Future = Future()

        def run_job():
            if (
                while_registering and not self._registering
            ) or not future.set_running_or_notify_cancel():
                future.cancel()
                return
            try:
                future.set_result(job())
            except Exception as exc:
                self._fault("job", exc)
                future.set_exception(exc)

        if tokens is None:
            thread.put(run_job)
        else:
            self._put_donor_work(run_job, tokens, on_drop=future.cancel, quick=quick)
        return future

    def _put_donor_work(
        self,
        job: Callable[[], None],
        tokens: int,
        on_drop: Callable[[], object] | None = None,
        quick: bool = False,
    ) -> None:
        self._backlog.add(job, tokens, on_drop, quick)
        self._background.put(self._backlog.run_next)

    def register(
        self,
        key: Hashable,
        serial: int,
        tokens_of: Callable[[], list[int] | None],
        then: Callable[[Embedded], None] | None = None,
        *,
        holds_tokens: int = 0,
        on_drop: Callable[[], object] | None = None,
    ) -> None:
        """Embed a donor: ``tokens_of()`` gives its tokens when its turn comes (None: the donor
        is gone, nothing to do), so the queue need not keep a copy; ``then(embedded)``, if
        given, runs on the background thread after. ``holds_tokens``: the tokens the callables
        keep alive (counted against the backlog); ``on_drop``: called (on the caller's thread)
        if the backlog drops this donor before its turn."""
        self._put_donor_work(
            lambda: self._register(key, serial, tokens_of, then, on_drop), holds_tokens, on_drop
        )

    def write_snapshot(self, write: Callable[[], None]) -> Future:
        future: Future = Future()

        def run():
            try:
                write()
                future.set_result(True)
            except Exception as exc:
                self._fault("snapshot", exc)
                future.set_exception(exc)

        self._background.put(run)
        return future

    def take_embedded(self) -> list[Embedded]:
        out = []
        while self._embedded:
            out.append(self._embedded.popleft())
        return out

    def stop_registrations(self) -> None:
        """Donors queued for embedding from now on are dropped (shutdown)."""
        self._registering = False

    def close(self, timeout_s: float = 30) -> None:
        for thread in (self._urgent, self._background):
            thread.close(timeout_s)

    def wait_idle(self, timeout_s: float = 60) -> bool:
        """Block until every job queued so far has run (tests, shutdown; donor work queued
        meanwhile may run in the place of one queued before, newest first)."""
        events = [t.drained() for t in (self._urgent, self._background)]
        return all(e.wait(timeout_s) for e in events)

    # ---- on the discovery threads -------------------------------------------------------------
    def _ready_embedder(self) -> Embedder | None:
        with self._embedder_lock:  # both threads may ask first; the model loads once
            if self._embedder is None and self.failed is None:
                self._load_embedder()
        return self._embedder

    def _load_embedder(self) -> None:
        try:
            t0 = time.perf_counter()
            self._embedder = self._make_embedder()
            self._detokenize([])  # loads the served model's tokenizer now too
            logger.info(
                "SemShare: donor discovery ready (%s, loaded in %.1f s)",
                self._embedder.name,
                time.perf_counter() - t0,
            )
        except Exception as exc:
            self.failed = f"{type(exc).__name__}: {exc}"
            logger.warning(
                "SemShare: the embedder could not be loaded, semantic donor "
                "discovery is off (exact-prefix reuse goes on): %s",
                self.failed,
            )

    def _embed(self, token_ids: list[int]) -> tuple[DocumentEmbedding, float]:
        t0 = time.perf_counter()
        embedding = self._embedder.embed(self._detokenize(token_ids))
        return embedding, (time.perf_counter() - t0) * 1e3

    def _lookup(self, future: Future, namespace: str, token_ids: list[int], asked: float) -> None:
        if not future.set_running_or_notify_cancel():
            return  # the request stopped waiting before its turn came
        try:
            fingerprint = simhash(token_ids)
            near = self.index.near_duplicates(namespace, fingerprint, NEAR_DUPLICATE_BITS)
            if near:
                future.set_result(Lookup(near[: self.top_k], None, fingerprint))
                return
            shared = self.index.shared_grams(namespace, sample_grams(token_ids), self.top_k)
            if shared is not None:
                best = shared[0].score if shared else 0.0
                if best < self.min_shared_grams:
                    # no donor could align enough same tokens: not worth an embedding
                    future.set_result(Lookup([], None, fingerprint, no_shared_grams=True))
                    return
                if best >= self.gram_match_share:
                    # the donor holds most of the prompt's text: a candidate by itself
                    future.set_result(
                        Lookup(
                            [c for c in shared if c.score >= self.gram_match_share],
                            None,
                            fingerprint,
                        )
                    )
                    return
            # no donor there has a vector yet (offered by its grams alone): nothing to embed for
            if self._ready_embedder() is None or self.index.size(namespace) == 0:
                future.set_result(Lookup([], None, fingerprint))
                return
            # what is left of the deadline: a lookup may have waited behind another's embedding
            left_ms = (
                None
                if self.deadline_ms is None
                else (self.deadline_ms - (time.monotonic() - asked) * 1e3)
            )
            if left_ms is not None:
                probe = EmbedSpeed.PROBE_TOKENS
                if self.embed_speed.due() and len(token_ids) > probe:
                    _, probe_ms = self._embed(token_ids[:probe])  # the rate, not blind
                    self.embed_speed.observe(probe, probe_ms)
                    left_ms -= probe_ms
                if not self.embed_speed.in_time(len(token_ids), left_ms):
                    future.set_result(Lookup([], None, fingerprint, too_long_to_embed=True))
                    return
            embedding, embed_ms = self._embed(token_ids)
            self.embed_speed.observe(len(token_ids), embed_ms)
            found = self.index.search(namespace, embedding.vector, self.top_k, self.threshold)
            future.set_result(Lookup(found, embedding, fingerprint, embed_ms))
            self.index.build_pending(namespace)  # a FAISS table, once it outgrew exact search
        except Exception as exc:
            self._fault("lookup", exc)
            if not future.done():
                future.set_exception(exc)

    def _register(
        self,
        key: Hashable,
        serial: int,
        tokens_of: Callable[[], list[int] | None],
        then: Callable[[Embedded], None] | None,
        on_drop: Callable[[], object] | None = None,
    ) -> None:
        if not self._registering:
            return
        embedded = None
        try:
            token_ids = tokens_of()
            if token_ids is not None and self._ready_embedder() is not None:
                embedding, embed_ms = self._embed(token_ids)
                embedded = Embedded(key, serial, embedding, simhash(token_ids), embed_ms)
                self._embedded.append(embedded)
                if then is not None:
                    then(embedded)
        except Exception as exc:
            self._fault("register", exc)
        if embedded is None and on_drop is not None:
            on_drop()  # no embedding will come (embedder off, failed, or donor gone)

    def _backlog_full(self) -> None:
        self.stats.add("discovery_backlog_skipped")
        warn_once(
            logger,
            "discovery:backlog",
            "SemShare: donors arrive faster than they are embedded; the oldest waiting are "
            "dropped (found by their text only; counted as discovery_backlog_skipped)",
        )

    def _fault(self, where: str, exc: Exception) -> None:
        self.stats.add("discovery_faults")
        warn_once(
            logger,
            f"discovery:{where}",
            "SemShare: discovery %s failed: %s",
            where,
            exc,
            exc_info=exc,
        )


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


def build_discovery(
    config, tokenizer_path: str | None, stats: StatsRecorder | None = None
) -> DiscoveryService | None:
    """The discovery service the config asks for (None: ``embedder`` is "none", the model has
    no tokenizer to turn prompts back into text, or the embedder's model is not installed: then
    discovery is off with one warning, and vLLM starts as usual), counting into ``stats``."""
    if config.embedder == "none" or not tokenizer_path:
        return None
    from semshare_vllm.discovery.embedder import (
        embedder_identity,
        make_embedder,
        resolve_device,
    )

    try:
        embedder_id = embedder_identity()
    except Exception as exc:
        logger.warning(
            "SemShare: semantic donor discovery is off (exact-prefix reuse goes on): %s: %s",
            type(exc).__name__,
            exc,
        )
        return None
    device = resolve_device(config.embedder_device)
    index = VectorIndex(kind=config.index_kind, exact_max=config.exact_search_max)
    return DiscoveryService(
        lambda: make_embedder(config.embedder, device=device),
        hf_detokenizer(tokenizer_path),
        index,
        top_k=config.top_k,
        threshold=config.similarity_threshold,
        embedder_id=embedder_id,
        min_shared_grams=config.lookup_min_shared_grams,
        deadline_ms=config.lookup_deadline_ms,
        stats=stats,
    )
