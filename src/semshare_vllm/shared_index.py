"""The donor index shared across vLLM instances: a Redis (or Valkey) stream of donor records.

Each instance publishes a record for every donor it captures, and reads every other instance's
records into its own catalog and search index. A record holds what a lookup and an alignment
need: the namespace, the donor's token ids (its id is derived from them and checked on arrival),
how many are prompt, and its embedding. The KV location needs no field: it is LMCache's keys of
the donor's tokens (``kv_tier`` "lmcache" with ``lmcache_remote_url``), which every instance
derives alike.

Record and KV travel apart, and neither waits for vLLM to step an idle engine: the scheduler
publishes the record when the donor's embedding is ready (on the discovery thread), and each
worker rank, once its LMCache put is readable, sets a small readiness key (``KVReadyMarks``). A
reader holds a record until every rank's key exists (dropped, counted, after ``READY_WAIT_S``),
so another instance never claims KV that is not there yet.

One stream per model geometry (``KVGeometry.fingerprint``), so instances serving other models or
layouts never see each other's donors. A new instance reads the stream from its start (catch-up),
then follows it. The stream is trimmed to ``MAX_RECORDS``; a donor whose KV the backend has since
dropped costs one failed load (counted), and that instance forgets it.

Nothing here blocks vLLM's scheduler: publishing and reading run on one thread, which retries
with a growing pause while Redis is unreachable (each outage counted once, logged once) and
resumes from the last record it read when Redis is back.
"""

from __future__ import annotations

import collections
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass

import numpy as np

from semshare_vllm.discovery.embedder import DocumentEmbedding
from semshare_vllm.logs import warn_once

logger = logging.getLogger("vllm.semshare.shared_index")

FORMAT = b"1"
MAX_RECORDS = 100_000          # approximate stream length (XADD MAXLEN ~)
READ_BATCH = 256               # records per XREAD
BLOCK_MS = 100                 # how long one XREAD waits for new records (publishes wait at most that)
MAX_PENDING = 10_000           # records arrived but not yet taken by the scheduler
RETRY_S = (0.2, 5.0)           # pause after a failure: first, largest (doubling)
READY_WAIT_S = 120.0           # how long a record waits for its KV's readiness keys
READY_TTL_S = 7 * 24 * 3600    # readiness keys expire (the KV is usually evicted sooner)


def stream_name(fingerprint: str) -> str:
    return f"semshare:donors:{fingerprint}"


def ready_key(fingerprint: str, donor_id: str, rank: int) -> str:
    return f"semshare:ready:{fingerprint}:{donor_id}:{rank}"


class KVReadyMarks:
    """A worker rank's side: say that a donor's KV shard is readable from LMCache's backend."""

    def __init__(self, url: str, fingerprint: str, rank: int):
        import redis

        self.fingerprint, self.rank = fingerprint, rank
        self._redis = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
        self._errors = (redis.RedisError, OSError)

    def mark(self, donor_id: str) -> bool:
        """False when Redis is unreachable (the record then waits, then is dropped)."""
        try:
            self._redis.set(ready_key(self.fingerprint, donor_id, self.rank), b"1",
                            ex=READY_TTL_S)
            return True
        except self._errors:
            return False

    def close(self) -> None:
        self._redis.close()


@dataclass
class SharedDonor:
    namespace: str
    donor_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    ranks: int = 1                          # tensor-parallel ranks holding a KV shard each
    embedding: DocumentEmbedding | None = None
    fingerprint: int | None = None          # the prompt's SimHash
    embedder_id: str = ""                   # vectors from another embedder are not used

    def encode(self, instance: str) -> dict[bytes, bytes]:
        fields = {b"v": FORMAT, b"instance": instance.encode(), b"ns": self.namespace.encode(),
                  b"id": self.donor_id.encode(),
                  b"tokens": np.asarray(self.token_ids, dtype="<i4").tobytes(),
                  b"prompt": str(self.num_prompt_tokens).encode(),
                  b"ranks": str(self.ranks).encode(),
                  b"embedder": self.embedder_id.encode()}
        if self.embedding is not None and self.fingerprint is not None:
            e = self.embedding
            fields.update({b"vec": np.asarray(e.vector, dtype="<f4").tobytes(),
                           b"seg": np.asarray(e.segments, dtype="<f4").tobytes(),
                           b"seg_rows": str(len(e.segments)).encode(),
                           b"enc_tokens": str(e.num_tokens).encode(),
                           b"simhash": str(self.fingerprint).encode()})
        return fields

    @classmethod
    def decode(cls, fields: dict[bytes, bytes]) -> "tuple[str, SharedDonor]":
        """(publishing instance, record); raises ValueError for a record this format cannot read."""
        if fields.get(b"v") != FORMAT:
            raise ValueError(f"record format {fields.get(b'v')!r}")
        record = cls(fields[b"ns"].decode(), fields[b"id"].decode(),
                     np.frombuffer(fields[b"tokens"], dtype="<i4").astype(np.int64).tolist(),
                     int(fields[b"prompt"]), int(fields[b"ranks"]),
                     embedder_id=fields[b"embedder"].decode())
        if b"vec" in fields:
            vector = np.frombuffer(fields[b"vec"], dtype="<f4").copy()
            rows = int(fields[b"seg_rows"])
            segments = np.frombuffer(fields[b"seg"], dtype="<f4").copy().reshape(rows, -1)
            record.embedding = DocumentEmbedding(vector, segments, int(fields[b"enc_tokens"]))
            record.fingerprint = int(fields[b"simhash"])
        return fields[b"instance"].decode(), record


class SharedDonorFeed:
    """Publish this instance's donor records; collect the other instances' whose KV is readable
    (``take_arrived``)."""

    def __init__(self, url: str, fingerprint: str, instance: str | None = None,
                 ready_wait_s: float = READY_WAIT_S):
        import redis

        self.url = url
        self.fingerprint = fingerprint
        self.stream = stream_name(fingerprint)
        self.ready_wait_s = ready_wait_s
        self.instance = instance or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._redis = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=2)
        self._errors = (redis.RedisError, OSError)
        self._outbox: collections.deque[SharedDonor] = collections.deque()
        self._arrived: collections.deque[SharedDonor] = collections.deque()
        # read, waiting for their KV's readiness keys: donor id -> (record, when first read)
        self._unready: dict[str, tuple[SharedDonor, float]] = {}
        self._counts: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        self._last_id = b"0-0"            # catch up from the stream's start
        self._down = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="semshare-shared-index",
                                        daemon=True)
        self._thread.start()
        logger.info("SemShare: sharing donors through stream %s at %s (this instance: %s)",
                    self.stream, url, self.instance)

    # ---- scheduler thread ---------------------------------------------------------------------
    def publish(self, record: SharedDonor) -> None:
        """Queue a record (any thread)."""
        self._outbox.append(record)

    def take_arrived(self) -> list[SharedDonor]:
        out = []
        while self._arrived:
            out.append(self._arrived.popleft())
        return out

    def take_counts(self) -> dict[str, int]:
        """Counts since the last call: published, publish_failures, received, dropped (records
        this format cannot read, or beyond ``MAX_PENDING``), unready (their KV never became
        readable), outages."""
        with self._lock:
            out, self._counts = dict(self._counts), collections.Counter()
        return out

    @property
    def connected(self) -> bool:
        return not self._down

    def close(self, timeout_s: float = 10) -> None:
        self._stop.set()
        self._thread.join(timeout_s)
        try:
            self._redis.close()
        except Exception:
            pass

    # ---- feed thread --------------------------------------------------------------------------
    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def _loop(self) -> None:
        pause = RETRY_S[0]
        while not self._stop.is_set():
            try:
                self._publish_pending()
                self._read()
                self._release_ready()
            except self._errors as exc:
                if not self._down:
                    self._down = True
                    self._count("outages")
                    logger.warning("SemShare: the shared donor index at %s is unreachable (%s); "
                                   "this instance goes on with its own donors and retries",
                                   self.url, exc)
                self._stop.wait(pause)
                pause = min(pause * 2, RETRY_S[1])
                continue
            except Exception as exc:   # a defect here must not end sharing for good
                warn_once(logger, "shared_index", "SemShare: shared donor index: %s", exc,
                          exc_info=exc)
                self._stop.wait(pause)
                continue
            if self._down:
                self._down = False
                logger.info("SemShare: the shared donor index at %s is back", self.url)
            pause = RETRY_S[0]

    def _publish_pending(self) -> None:
        while self._outbox:
            record = self._outbox.popleft()
            try:
                self._redis.xadd(self.stream, record.encode(self.instance), maxlen=MAX_RECORDS,
                                 approximate=True)
            except Exception:
                # Not retried: the donor's KV went into the same server, which may have lost it.
                self._count("publish_failures")
                raise
            self._count("published")

    def _read(self) -> None:
        reply = self._redis.xread({self.stream: self._last_id}, count=READ_BATCH, block=BLOCK_MS)
        for _stream, entries in reply or ():
            for entry_id, fields in entries:
                self._last_id = entry_id
                try:
                    instance, record = SharedDonor.decode(fields)
                except (KeyError, ValueError) as exc:
                    self._count("dropped")
                    logger.debug("SemShare: unreadable shared donor record %s: %s", entry_id, exc)
                    continue
                if instance == self.instance:
                    continue
                if len(self._unready) + len(self._arrived) >= MAX_PENDING:
                    self._count("dropped")
                    continue
                self._unready[record.donor_id] = (record, time.monotonic())

    def _release_ready(self) -> None:
        """Hand over the records whose every KV shard is readable; drop those that waited too
        long (their instance's put failed, or it went away)."""
        if not self._unready:
            return
        waiting = list(self._unready.values())
        pipe = self._redis.pipeline(transaction=False)
        for record, _ in waiting:
            pipe.exists(*[ready_key(self.fingerprint, record.donor_id, r)
                          for r in range(record.ranks)])
        found = pipe.execute()
        now = time.monotonic()
        for (record, since), n in zip(waiting, found):
            if n == record.ranks:
                del self._unready[record.donor_id]
                self._arrived.append(record)
                self._count("received")
            elif now - since > self.ready_wait_s:
                del self._unready[record.donor_id]
                self._count("unready")
