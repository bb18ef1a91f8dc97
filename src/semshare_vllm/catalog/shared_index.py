"""The donor index shared across vLLM instances: a Redis (or Valkey) stream of donor records.

Each instance publishes a record for every donor it captures, and reads every other instance's
records into its own catalog and search index. What a record holds, and how records and
readiness marks are signed and checked, is ``shared_records.py``.

Record and KV travel apart, and neither waits for vLLM to step an idle engine: the scheduler
publishes the record when the donor's embedding is ready (on the discovery thread), and each
worker rank, once its LMCache put is readable, sets a small readiness key (``KVReadyMarks``). A
reader holds a record until every rank's key exists, signed with the instances' secret (dropped,
counted, after ``READY_WAIT_S``), so another instance never claims KV that is not there yet.

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

from semshare_vllm.catalog.shared_records import (
    FORMAT,
    MAX_TOKENS,
    SharedDonor,
    sign_mark,
    sign_record,
    verify_mark,
    verify_record,
)
from semshare_vllm.core.counters import StatsRecorder
from semshare_vllm.logs import warn_once

logger = logging.getLogger("vllm.semshare.shared_index")

MAX_RECORDS = 100_000  # approximate stream length (XADD MAXLEN ~)
READ_BATCH = 256  # records per XREAD
BLOCK_MS = 100  # how long one XREAD waits for records (publishes wait at most that)
MAX_PENDING = 10_000  # records arrived but not yet taken by the scheduler
RETRY_S = (0.2, 5.0)  # pause after a failure: first, largest (doubling)
READY_WAIT_S = 120.0  # how long a record waits for its KV's readiness keys
READY_TTL_S = 7 * 24 * 3600  # readiness keys expire (the KV is usually evicted sooner)


def stream_name(fingerprint: str) -> str:
    return f"semshare:donors:{fingerprint}"


def ready_key(fingerprint: str, donor_id: str, rank: int) -> str:
    return f"semshare:ready:{fingerprint}:{donor_id}:{rank}"


class KVReadyMarks:
    """A worker rank's side: say that a donor's KV shard is readable from LMCache's backend."""

    def __init__(self, url: str, fingerprint: str, rank: int, secret: str):
        import redis

        if not secret:
            raise ValueError("KVReadyMarks needs the shared index secret")
        self.fingerprint, self.rank, self._secret = fingerprint, rank, secret
        self._redis = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
        self._errors = (redis.RedisError, OSError)

    def mark(self, donor_id: str, digest: str) -> bool:
        """Say so, with ``digest`` (``kv_digest``) of the shard this rank put; signed. False when
        Redis is unreachable (the record then waits, then is dropped)."""
        value = sign_mark(digest, self.fingerprint, donor_id, self.rank, self._secret)
        try:
            self._redis.set(ready_key(self.fingerprint, donor_id, self.rank), value, ex=READY_TTL_S)
            return True
        except self._errors:
            return False

    def close(self) -> None:
        self._redis.close()


class SharedDonorFeed:
    """Publish this instance's donor records; collect the other instances' whose KV is readable
    (``take_arrived``). It counts into ``stats``: donors_published, shared_publish_failures,
    shared_records_dropped (records this format cannot read, that do not fit this engine, or
    beyond ``MAX_PENDING``), shared_records_forged (records not signed with the secret; records
    dropped as unready that had a readiness mark not signed with it), shared_records_unready
    (their KV never became readable), shared_index_outages."""

    def __init__(
        self,
        url: str,
        fingerprint: str,
        instance: str | None = None,
        ready_wait_s: float = READY_WAIT_S,
        *,
        secret: str,
        tp_size: int = 1,
        max_tokens: int = MAX_TOKENS,
        stats: StatsRecorder | None = None,
    ):
        """``secret``: the key all instances sign with; ``tp_size``: this engine's
        tensor-parallel size (a record must have as many KV shards); ``max_tokens``: the most
        tokens a record may hold (the engine's max_model_len); ``stats``: the scheduler half's
        recorder, counted into from the feed's thread."""
        import redis

        if not secret:
            raise ValueError("the shared donor index needs a secret (shared_index_secret)")
        self.url = url
        self.fingerprint = fingerprint
        self.stream = stream_name(fingerprint)
        self.ready_wait_s = ready_wait_s
        self.tp_size, self.max_tokens = tp_size, max_tokens
        self._secret = secret
        self.instance = instance or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._redis = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=2)
        self._errors = (redis.RedisError, OSError)
        self._outbox: collections.deque[SharedDonor] = collections.deque()
        self._arrived: collections.deque[SharedDonor] = collections.deque()
        # read, waiting for their KV's readiness keys: donor id -> [record, when first read,
        # whether a mark that does not verify was seen]
        self._unready: dict[str, list] = {}
        self.stats = StatsRecorder() if stats is None else stats
        self._last_id = b"0-0"  # catch up from the stream's start
        self._down = False
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._loop, name="semshare-shared-index", daemon=True
        )
        self._thread.start()
        logger.info(
            "SemShare: sharing donors through stream %s at %s (this instance: %s)",
            self.stream,
            url,
            self.instance,
        )

    # ---- scheduler thread ---------------------------------------------------------------------
    def publish(self, record: SharedDonor) -> None:
        """Queue a record (any thread)."""
        self._outbox.append(record)

    def take_arrived(self) -> list[SharedDonor]:
        out = []
        while self._arrived:
            out.append(self._arrived.popleft())
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
                    self.stats.add("shared_index_outages")
                    logger.warning(
                        "SemShare: the shared donor index at %s is unreachable (%s); "
                        "this instance goes on with its own donors and retries",
                        self.url,
                        exc,
                    )
                self._stop.wait(pause)
                pause = min(pause * 2, RETRY_S[1])
                continue
            except Exception as exc:  # a defect here must not end sharing for good
                warn_once(
                    logger, "shared_index", "SemShare: shared donor index: %s", exc, exc_info=exc
                )
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
                fields = sign_record(record.encode(self.instance), self.fingerprint, self._secret)
                self._redis.xadd(self.stream, fields, maxlen=MAX_RECORDS, approximate=True)
            except Exception:
                # Not retried: the donor's KV went into the same server, which may have lost it.
                self.stats.add("shared_publish_failures")
                raise
            self.stats.add("donors_published")

    def _read(self) -> None:
        reply = self._redis.xread({self.stream: self._last_id}, count=READ_BATCH, block=BLOCK_MS)
        for _stream, entries in reply or ():
            for entry_id, fields in entries:
                self._last_id = entry_id  # first: no record can hold up the feed
                try:
                    if fields.get(b"v") == FORMAT and not verify_record(
                        fields, self.fingerprint, self._secret
                    ):
                        self.stats.add("shared_records_forged")
                        warn_once(
                            logger,
                            "shared_forged",
                            "SemShare: a record on %s is not "
                            "signed with this instance's shared_index_secret (another "
                            "secret, or forged); dropped",
                            self.stream,
                        )
                        continue
                    instance, record = SharedDonor.decode(fields, self.tp_size, self.max_tokens)
                except Exception as exc:  # whatever its bytes, it costs that record
                    self.stats.add("shared_records_dropped")
                    logger.debug("SemShare: unusable shared donor record %s: %s", entry_id, exc)
                    continue
                if instance == self.instance:
                    continue
                if len(self._unready) + len(self._arrived) >= MAX_PENDING:
                    self.stats.add("shared_records_dropped")
                    continue
                self._unready[record.donor_id] = [record, time.monotonic(), False]

    def _release_ready(self) -> None:
        """Hand over the records whose every KV shard is marked readable, by marks signed with
        the secret (their digests go with the record); drop those that waited too long (their
        instance's put failed, or it went away, or their marks are forged)."""
        if not self._unready:
            return
        waiting = list(self._unready.values())
        pipe = self._redis.pipeline(transaction=False)
        for record, _, _ in waiting:  # ranks == tp_size (checked on arrival)
            pipe.mget(
                [ready_key(self.fingerprint, record.donor_id, r) for r in range(record.ranks)]
            )
        found = pipe.execute()
        now = time.monotonic()
        for entry, values in zip(waiting, found):
            record, since = entry[0], entry[1]
            digests = [
                verify_mark(v, self.fingerprint, record.donor_id, r, self._secret)
                for r, v in enumerate(values)
            ]
            if all(d is not None for d in digests):
                del self._unready[record.donor_id]
                record.kv_digests = digests
                self._arrived.append(record)
                continue
            if any(v is not None and d is None for v, d in zip(values, digests)):
                entry[2] = True  # a mark is there, not signed with the secret
            if now - since > self.ready_wait_s:
                del self._unready[record.donor_id]
                self.stats.add("shared_records_unready")
                if entry[2]:
                    self.stats.add("shared_records_forged")
