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

Trust: every instance holds the same secret (``shared_index_secret``). Each record carries an
HMAC-SHA256 of all its fields (and of its stream), and each readiness mark the digest of the KV
shard its rank put (``kv_digest``) with an HMAC of (stream, donor, rank, digest). A reader drops,
and counts as forged, a record or mark that does not verify (a mark that does not verify is as
good as absent), so a client of the Redis server without the secret can neither announce a donor
nor make one look ready. The per-rank digests travel with the record (``SharedDonor.kv_digests``)
to the worker, which refuses KV fetched from LMCache that does not match its rank's digest.
Every field is also checked against this engine before a record goes further (its tensor-parallel
size, token counts, embedding shapes): a record that does not fit is dropped and counted.

Nothing here blocks vLLM's scheduler: publishing and reading run on one thread, which retries
with a growing pause while Redis is unreachable (each outage counted once, logged once) and
resumes from the last record it read when Redis is back.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import logging
import os
import re
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np

from semshare_vllm.core.counters import StatsRecorder
from semshare_vllm.discovery.embedder import DocumentEmbedding
from semshare_vllm.logs import warn_once

logger = logging.getLogger("vllm.semshare.shared_index")

FORMAT = b"2"                  # 2: signed records and marks
MAX_RECORDS = 100_000          # approximate stream length (XADD MAXLEN ~)
READ_BATCH = 256               # records per XREAD
BLOCK_MS = 100                 # how long one XREAD waits for records (publishes wait at most that)
MAX_PENDING = 10_000           # records arrived but not yet taken by the scheduler
RETRY_S = (0.2, 5.0)           # pause after a failure: first, largest (doubling)
READY_WAIT_S = 120.0           # how long a record waits for its KV's readiness keys
READY_TTL_S = 7 * 24 * 3600    # readiness keys expire (the KV is usually evicted sooner)
SIG = b"sig"                   # the record field holding its signature

# What a record may hold (checked on arrival; beyond it the record is dropped).
MAX_TOKENS = 1 << 20           # when the engine does not say (its max_model_len)
MAX_NAME_BYTES = 1 << 16       # namespace, instance, embedder
MAX_EMBED_DIM = 1 << 16
MAX_EMBED_ELEMENTS = 1 << 24   # segments rows * dim
_DECIMAL = re.compile(rb"0|[1-9][0-9]{0,19}")
_DONOR_ID = re.compile(r"[0-9a-f]{32}")
_DIGEST = re.compile(rb"[0-9a-f]{64}")


def stream_name(fingerprint: str) -> str:
    return f"semshare:donors:{fingerprint}"


def ready_key(fingerprint: str, donor_id: str, rank: int) -> str:
    return f"semshare:ready:{fingerprint}:{donor_id}:{rank}"


def _canonical(parts: Iterable[bytes]) -> bytes:
    """One byte string per sequence of parts, each length-prefixed (no two sequences alike)."""
    return b"".join(len(p).to_bytes(8, "big") + p for p in parts)


def _mac(secret: str, parts: Iterable[bytes]) -> bytes:
    return hmac.new(secret.encode(), _canonical(parts), hashlib.sha256).hexdigest().encode()


def record_signature(fields: dict[bytes, bytes], fingerprint: str, secret: str) -> bytes:
    """HMAC-SHA256 (hex) of every field but the signature, sorted by name, and of the stream."""
    parts = [b"semshare-record", fingerprint.encode()]
    for name in sorted(n for n in fields if n != SIG):
        parts += [name, fields[name]]
    return _mac(secret, parts)


def sign_record(fields: dict[bytes, bytes], fingerprint: str, secret: str) -> dict[bytes, bytes]:
    """``fields`` with their signature added."""
    return {**fields, SIG: record_signature(fields, fingerprint, secret)}


def verify_record(fields: dict[bytes, bytes], fingerprint: str, secret: str) -> bool:
    sig = fields.get(SIG)
    return isinstance(sig, bytes) and hmac.compare_digest(
        sig, record_signature(fields, fingerprint, secret))


def _mark_mac(secret: str, fingerprint: str, donor_id: str, rank: int, digest: bytes) -> bytes:
    return _mac(secret, [b"semshare-ready", fingerprint.encode(), donor_id.encode(),
                         str(rank).encode(), digest])


def kv_digest(rows, dtype=None) -> str:
    """blake2b-256 (hex) of a donor's KV shard as it is stored: its rows ``[L, T, H, 2D]`` in the
    store's ``dtype`` (what a fetch returns), with their shape and dtype."""
    import torch

    t = rows.detach().cpu()
    if dtype is not None:
        t = t.to(dtype)
    t = t.contiguous()
    h = hashlib.blake2b(digest_size=32)
    h.update(f"{t.dtype}|{tuple(t.shape)}|".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def verify_mark(value, fingerprint: str, donor_id: str, rank: int, secret: str) -> str | None:
    """The KV digest a readiness mark's value carries, or None when it is not a mark signed with
    ``secret`` for this donor and rank."""
    if not isinstance(value, bytes):
        return None
    digest, sep, mac = value.partition(b":")
    if not sep or not _DIGEST.fullmatch(digest) or not hmac.compare_digest(
            mac, _mark_mac(secret, fingerprint, donor_id, rank, digest)):
        return None
    return digest.decode()


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
        d = digest.encode()
        if not _DIGEST.fullmatch(d):
            raise ValueError(f"not a KV digest: {digest!r}")
        value = d + b":" + _mark_mac(self._secret, self.fingerprint, donor_id, self.rank, d)
        try:
            self._redis.set(ready_key(self.fingerprint, donor_id, self.rank), value,
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
    # per rank, the digest of the KV shard it put (from its signed readiness mark; not encoded)
    kv_digests: list[str] = field(default_factory=list)

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
    def decode(cls, fields: dict[bytes, bytes], ranks: int | None = None,
               max_tokens: int = MAX_TOKENS) -> "tuple[str, SharedDonor]":
        """(publishing instance, record); raises ValueError (or KeyError) for a record this format
        cannot read, or one that does not fit this engine: ``ranks`` other than its
        tensor-parallel size, more than ``max_tokens`` tokens, a field out of range. (Its
        signature is checked before: ``verify_record``.)"""
        if fields.get(b"v") != FORMAT:
            raise ValueError(f"record format {fields.get(b'v')!r}")

        def raw(name: bytes) -> bytes:
            value = fields[name]
            if not isinstance(value, bytes):
                raise ValueError(f"{name!r}: not bytes")
            return value

        def text(name: bytes, limit: int = MAX_NAME_BYTES) -> str:
            value = raw(name)
            if len(value) > limit:
                raise ValueError(f"{name!r}: {len(value)} bytes")
            return value.decode("utf-8")           # UnicodeDecodeError is a ValueError

        def number(name: bytes, lo: int, hi: int) -> int:
            value = raw(name)
            if not _DECIMAL.fullmatch(value) or not lo <= int(value) <= hi:
                raise ValueError(f"{name!r}: {value[:24]!r} is not an integer in [{lo}, {hi}]")
            return int(value)

        instance, namespace, embedder = text(b"instance"), text(b"ns"), text(b"embedder")
        donor_id = text(b"id", 32)
        if not _DONOR_ID.fullmatch(donor_id):
            raise ValueError(f"donor id {donor_id!r}")
        packed = raw(b"tokens")
        if not packed or len(packed) % 4 or len(packed) // 4 > max_tokens:
            raise ValueError(f"{len(packed)} bytes of tokens (at most {max_tokens} int32)")
        tokens = np.frombuffer(packed, dtype="<i4")
        if (tokens < 0).any():
            raise ValueError("a negative token id")
        record = cls(namespace, donor_id, tokens.astype(np.int64).tolist(),
                     number(b"prompt", 1, len(tokens)), number(b"ranks", 1, 1 << 16),
                     embedder_id=embedder)
        if ranks is not None and record.ranks != ranks:
            raise ValueError(f"{record.ranks} ranks; this engine has {ranks}")
        present = [name in fields for name in (b"vec", b"seg", b"seg_rows", b"enc_tokens",
                                               b"simhash")]
        if any(present):
            if not all(present):
                raise ValueError("a partial embedding")
            vec, seg = raw(b"vec"), raw(b"seg")
            dim = len(vec) // 4
            if not vec or len(vec) % 4 or dim > MAX_EMBED_DIM:
                raise ValueError(f"{len(vec)} bytes of vector")
            rows = number(b"seg_rows", 1, MAX_EMBED_ELEMENTS // dim)
            if len(seg) != rows * dim * 4:
                raise ValueError(f"{len(seg)} bytes of segments, not {rows} x {dim} float32")
            vector = np.frombuffer(vec, dtype="<f4").astype(np.float32)      # a copy
            segments = np.frombuffer(seg, dtype="<f4").astype(np.float32).reshape(rows, dim)
            if not (np.isfinite(vector).all() and np.isfinite(segments).all()):
                raise ValueError("a non-finite embedding")
            record.embedding = DocumentEmbedding(vector, segments,
                                                 number(b"enc_tokens", 0, 1 << 40))
            record.fingerprint = number(b"simhash", 0, 2**64 - 1)
        return instance, record


class SharedDonorFeed:
    """Publish this instance's donor records; collect the other instances' whose KV is readable
    (``take_arrived``). It counts into ``stats``: donors_published, shared_publish_failures,
    shared_records_dropped (records this format cannot read, that do not fit this engine, or
    beyond ``MAX_PENDING``), shared_records_forged (records not signed with the secret; records
    dropped as unready that had a readiness mark not signed with it), shared_records_unready
    (their KV never became readable), shared_index_outages."""

    def __init__(self, url: str, fingerprint: str, instance: str | None = None,
                 ready_wait_s: float = READY_WAIT_S, *, secret: str, tp_size: int = 1,
                 max_tokens: int = MAX_TOKENS, stats: StatsRecorder | None = None):
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
                fields = sign_record(record.encode(self.instance), self.fingerprint,
                                     self._secret)
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
                self._last_id = entry_id          # first: no record can hold up the feed
                try:
                    if fields.get(b"v") == FORMAT and not verify_record(
                            fields, self.fingerprint, self._secret):
                        self.stats.add("shared_records_forged")
                        warn_once(logger, "shared_forged", "SemShare: a record on %s is not "
                                  "signed with this instance's shared_index_secret (another "
                                  "secret, or forged); dropped", self.stream)
                        continue
                    instance, record = SharedDonor.decode(fields, self.tp_size, self.max_tokens)
                except Exception as exc:          # whatever its bytes, it costs that record
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
        for record, _, _ in waiting:     # ranks == tp_size (checked on arrival)
            pipe.mget([ready_key(self.fingerprint, record.donor_id, r)
                       for r in range(record.ranks)])
        found = pipe.execute()
        now = time.monotonic()
        for entry, values in zip(waiting, found):
            record, since = entry[0], entry[1]
            digests = [verify_mark(v, self.fingerprint, record.donor_id, r, self._secret)
                       for r, v in enumerate(values)]
            if all(d is not None for d in digests):
                del self._unready[record.donor_id]
                record.kv_digests = digests
                self._arrived.append(record)
                continue
            if any(v is not None and d is None for v, d in zip(values, digests)):
                entry[2] = True                  # a mark is there, not signed with the secret
            if now - since > self.ready_wait_s:
                del self._unready[record.donor_id]
                self.stats.add("shared_records_unready")
                if entry[2]:
                    self.stats.add("shared_records_forged")
