"""The donors' embeddings on disk, beside their KV files, so a restart need not re-embed them.

One file, ``discovery.v1.npz`` (the format version is in the name and inside), replaced
atomically: written to a temporary file in the same directory, fsynced, renamed over the old one,
and the directory fsynced. A process killed at any point leaves either the previous snapshot or
the new one, never a mix; a killed writer's temporary file is removed at the next load
(``core.temp_files``). A snapshot made by another embedder (model or dimension) is ignored: its
donors are embedded again.
"""

from __future__ import annotations

import io
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from semshare_vllm.core import temp_files
from semshare_vllm.discovery.embedder import DocumentEmbedding

logger = logging.getLogger("vllm.semshare.snapshot")

VERSION = 1
FILENAME = f"discovery.v{VERSION}.npz"
_TMP_PREFIX = ".discovery."
STALE_TMP_S = 3600.0  # another host's temporary file this old was left by a killed writer


@dataclass
class SnapshotEntry:
    namespace: str
    donor_id: str
    embedding: DocumentEmbedding
    fingerprint: int
    hits: int = 0
    idle_s: float = 0.0  # seconds since last use, when written
    deviation_reports: int = 0
    deviation: float = 0.0
    demoted: bool = False


def write_snapshot(directory: str | Path, entries: list[SnapshotEntry], embedder_id: str) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    dim = entries[0].embedding.vector.shape[0] if entries else 0
    meta = {
        "version": VERSION,
        "embedder": embedder_id,
        "dim": dim,
        "written": time.time(),
        "donors": [
            {
                "namespace": e.namespace,
                "donor_id": e.donor_id,
                "hits": e.hits,
                "idle_s": e.idle_s,
                "deviation_reports": e.deviation_reports,
                "deviation": e.deviation,
                "demoted": e.demoted,
                "num_tokens": e.embedding.num_tokens,
            }
            for e in entries
        ],
    }
    segs = [e.embedding.segments for e in entries]
    arrays = {
        "meta": np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8),
        "vectors": np.stack([e.embedding.vector for e in entries])
        if entries
        else np.zeros((0, 0), np.float32),
        "fingerprints": np.asarray([e.fingerprint for e in entries], dtype=np.uint64),
        "segment_offsets": np.cumsum([0] + [len(s) for s in segs]).astype(np.int64),
        "segments": np.concatenate(segs) if segs else np.zeros((0, 0), np.float32),
    }
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    fd, tmp = temp_files.create(directory, _TMP_PREFIX, ".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(buf.getbuffer())
            f.flush()
            os.fsync(f.fileno())
        final = directory / FILENAME
        os.replace(tmp, final)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return final


def load_snapshot(directory: str | Path, embedder_id: str) -> dict[tuple[str, str], SnapshotEntry]:
    """The entries of the snapshot in ``directory`` by (namespace, donor id); empty when there is
    none, or it is unreadable or from another embedder (logged)."""
    directory = Path(directory)
    if directory.is_dir():  # not another instance's, writing now
        for stray in temp_files.left_behind(directory, _TMP_PREFIX, ".tmp", STALE_TMP_S):
            try:
                stray.unlink(missing_ok=True)
            except OSError:  # another user's: left, never read
                pass
    path = directory / FILENAME
    if not path.is_file():
        return {}
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(bytes(z["meta"]).decode())
            vectors, fingerprints = z["vectors"], z["fingerprints"]
            offsets, segments = z["segment_offsets"], z["segments"]
        if meta.get("version") != VERSION:
            raise ValueError(f"version {meta.get('version')}")
        donors = meta["donors"]
        if not (len(donors) == len(vectors) == len(fingerprints) == len(offsets) - 1):
            raise ValueError("array lengths disagree")
    except Exception as exc:
        logger.warning(
            "SemShare: ignoring the discovery snapshot %s (%s); donors are embedded again",
            path,
            exc,
        )
        return {}
    if meta.get("embedder") != embedder_id:
        logger.info(
            "SemShare: discovery snapshot %s was made by %s, not %s; donors are embedded again",
            path,
            meta.get("embedder"),
            embedder_id,
        )
        return {}
    out = {}
    for i, d in enumerate(donors):
        emb = DocumentEmbedding(vectors[i], segments[offsets[i] : offsets[i + 1]], d["num_tokens"])
        out[(d["namespace"], d["donor_id"])] = SnapshotEntry(
            d["namespace"],
            d["donor_id"],
            emb,
            int(fingerprints[i]),
            d["hits"],
            d["idle_s"],
            d["deviation_reports"],
            d["deviation"],
            d["demoted"],
        )
    return out
