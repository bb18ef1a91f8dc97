"""The records of the shared donor index (``shared_index.py``): their format and their trust.

A record holds what a lookup and an alignment need: the namespace, the donor's token ids (its id
is derived from them and checked on arrival), how many are prompt, and its embedding. The KV
location needs no field: it is LMCache's keys of the donor's tokens (``kv_tier`` "lmcache" with
``lmcache_remote_url``), which every instance derives alike.

Trust: every instance holds the same secret (``shared_index_secret``). Each record carries an
HMAC-SHA256 of all its fields (and of its stream), and each readiness mark the digest of the KV
shard its rank put (``kv_digest``) with an HMAC of (stream, donor, rank, digest). A reader drops,
and counts as forged, a record or mark that does not verify (a mark that does not verify is as
good as absent), so a client of the Redis server without the secret can neither announce a donor
nor make one look ready. The per-rank digests travel with the record (``SharedDonor.kv_digests``)
to the worker, which refuses KV fetched from LMCache that does not match its rank's digest.
Every field is also checked against this engine before a record goes further (its tensor-parallel
size, token counts, embedding shapes): a record that does not fit is dropped and counted.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np

from semshare_vllm.discovery.embedder import DocumentEmbedding

FORMAT = b"2"  # 2: signed records and marks
SIG = b"sig"  # the record field holding its signature

# What a record may hold (checked on arrival; beyond it the record is dropped).
MAX_TOKENS = 1 << 20  # when the engine does not say (its max_model_len)
MAX_NAME_BYTES = 1 << 16  # namespace, instance, embedder
MAX_EMBED_DIM = 1 << 16
MAX_EMBED_ELEMENTS = 1 << 24  # segments rows * dim
_DECIMAL = re.compile(rb"0|[1-9][0-9]{0,19}")
_DONOR_ID = re.compile(r"[0-9a-f]{32}")
_DIGEST = re.compile(rb"[0-9a-f]{64}")


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
        sig, record_signature(fields, fingerprint, secret)
    )


def _mark_mac(secret: str, fingerprint: str, donor_id: str, rank: int, digest: bytes) -> bytes:
    return _mac(
        secret,
        [b"semshare-ready", fingerprint.encode(), donor_id.encode(), str(rank).encode(), digest],
    )


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
    if (
        not sep
        or not _DIGEST.fullmatch(digest)
        or not hmac.compare_digest(mac, _mark_mac(secret, fingerprint, donor_id, rank, digest))
    ):
        return None
    return digest.decode()


def sign_mark(digest: str, fingerprint: str, donor_id: str, rank: int, secret: str) -> bytes:
    """A readiness mark's value: ``digest`` (``kv_digest``) of the shard ``rank`` put, signed
    with ``secret`` for this donor and rank (``verify_mark`` reads it back)."""
    d = digest.encode()
    if not _DIGEST.fullmatch(d):
        raise ValueError(f"not a KV digest: {digest!r}")
    return d + b":" + _mark_mac(secret, fingerprint, donor_id, rank, d)


@dataclass
class SharedDonor:
    namespace: str
    donor_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    ranks: int = 1  # tensor-parallel ranks holding a KV shard each
    embedding: DocumentEmbedding | None = None
    fingerprint: int | None = None  # the prompt's SimHash
    embedder_id: str = ""  # vectors from another embedder are not used
    # per rank, the digest of the KV shard it put (from its signed readiness mark; not encoded)
    kv_digests: list[str] = field(default_factory=list)

    def encode(self, instance: str) -> dict[bytes, bytes]:
        fields = {
            b"v": FORMAT,
            b"instance": instance.encode(),
            b"ns": self.namespace.encode(),
            b"id": self.donor_id.encode(),
            b"tokens": np.asarray(self.token_ids, dtype="<i4").tobytes(),
            b"prompt": str(self.num_prompt_tokens).encode(),
            b"ranks": str(self.ranks).encode(),
            b"embedder": self.embedder_id.encode(),
        }
        if self.embedding is not None and self.fingerprint is not None:
            e = self.embedding
            fields.update(
                {
                    b"vec": np.asarray(e.vector, dtype="<f4").tobytes(),
                    b"seg": np.asarray(e.segments, dtype="<f4").tobytes(),
                    b"seg_rows": str(len(e.segments)).encode(),
                    b"enc_tokens": str(e.num_tokens).encode(),
                    b"simhash": str(self.fingerprint).encode(),
                }
            )
        return fields

    @classmethod
    def decode(
        cls, fields: dict[bytes, bytes], ranks: int | None = None, max_tokens: int = MAX_TOKENS
    ) -> "tuple[str, SharedDonor]":
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
            return value.decode("utf-8")  # UnicodeDecodeError is a ValueError

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
        record = cls(
            namespace,
            donor_id,
            tokens.astype(np.int64).tolist(),
            number(b"prompt", 1, len(tokens)),
            number(b"ranks", 1, 1 << 16),
            embedder_id=embedder,
        )
        if ranks is not None and record.ranks != ranks:
            raise ValueError(f"{record.ranks} ranks; this engine has {ranks}")
        present = [
            name in fields for name in (b"vec", b"seg", b"seg_rows", b"enc_tokens", b"simhash")
        ]
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
            vector = np.frombuffer(vec, dtype="<f4").astype(np.float32)  # a copy
            segments = np.frombuffer(seg, dtype="<f4").astype(np.float32).reshape(rows, dim)
            if not (np.isfinite(vector).all() and np.isfinite(segments).all()):
                raise ValueError("a non-finite embedding")
            record.embedding = DocumentEmbedding(
                vector, segments, number(b"enc_tokens", 0, 1 << 40)
            )
            record.fingerprint = number(b"simhash", 0, 2**64 - 1)
        return instance, record
