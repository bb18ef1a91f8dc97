"""Donors across restarts (``persist_dir``): at start-up, index the donor files the worker wrote
(headers only; their data is checked when loaded) and the embeddings snapshot beside them; while
serving, rewrite that snapshot at most every ``SNAPSHOT_INTERVAL_S`` when it changed."""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from pathlib import Path

from semshare_vllm.catalog.donor_index import DonorRecord
from semshare_vllm.core.counters import StatsRecorder
from semshare_vllm.core.keys import DonorKey, block_hashes, donor_id_for
from semshare_vllm.discovery.snapshot import SnapshotEntry, load_snapshot, write_snapshot
from semshare_vllm.layout.geometry import KVGeometry
from semshare_vllm.logs import warn_once
from semshare_vllm.scheduler.donor_catalog import DonorCatalog
from semshare_vllm.scheduler.semantic_search import SemanticSearch
from semshare_vllm.store import donor_file

logger = logging.getLogger("vllm.semshare.scheduler")

# How often (at most) the donors' embeddings are written beside their KV files.
SNAPSHOT_INTERVAL_S = 30.0


def restore(
    root: Path,
    geometry: KVGeometry,
    catalog: DonorCatalog,
    search: SemanticSearch | None,
    stats: StatsRecorder,
) -> None:
    """Index the donors persisted under ``root``, with their saved embeddings and reuse history
    (a donor missing from the snapshot is embedded again)."""
    if not root.is_dir():
        return
    _remove_partials(root, stats)
    tp = geometry.tp_size
    files = sorted(root.glob(f"*.tp0of{tp}{donor_file.SUFFIX}"), key=_mtime)
    for path in files:
        try:
            header = donor_file.read_header(path)
            for rank in range(1, tp):
                donor_file.read_header(donor_file.donor_path(root, header.donor_id, rank, tp))
            if (
                donor_id_for(header.namespace, header.token_ids) != header.donor_id
                or list(geometry.layer_names) != header.layer_names
            ):
                raise donor_file.CorruptDonorFile(f"{path}: identity does not match contents")
        except (donor_file.CorruptDonorFile, ValueError, TypeError) as exc:  # (a header's
            # fields parse, but hold no token ids)
            warn_once(logger, "restore", "SemShare: skipping persisted donor: %s", exc)
            stats.add("persisted_skipped")
            continue
        n = len(header.token_ids)
        record = DonorRecord(
            DonorKey(header.namespace, header.donor_id),
            header.token_ids,
            geometry.donor_bytes(n),
            block_hashes(header.token_ids, geometry.block_size),
            num_prompt_tokens=header.num_prompt_tokens,  # (checked: 1 .. n, or None)
        )
        catalog.evict(catalog.index.add(record))  # (one larger than the store: its file too)
        stats.add("donors_restored")
    index = catalog.index
    if len(index):
        logger.info("SemShare: restored %d donors from %s", len(index), root)
    if search is None:
        return
    saved = load_snapshot(root, search.discovery.embedder_id)
    for record in index.records():
        entry = saved.get((record.key.namespace, record.key.donor_id))
        if entry is None:
            search.embed_donor(record)  # not in the snapshot: embed it again
            continue
        record.hits, record.deviation_reports = entry.hits, entry.deviation_reports
        record.deviation, record.demoted = entry.deviation, entry.demoted
        record.last_used = index.clock() - entry.idle_s
        index.set_embedding(record.key, record.serial, entry.embedding, entry.fingerprint)


def _remove_partials(root: Path, stats: StatsRecorder) -> None:
    for partial in donor_file.stale_partials(root):  # a writer killed mid-write
        try:
            partial.unlink(missing_ok=True)
            stats.add("persisted_incomplete")
        except OSError as exc:  # another user's file: left, never read
            warn_once(logger, "partial", "SemShare: cannot remove %s: %s", partial, exc)


class Snapshots:
    """Writes the donors' embeddings and reuse history beside their files, on the discovery
    thread, when the catalog changed."""

    def __init__(self, root: Path, catalog: DonorCatalog, search: SemanticSearch):
        self.root = root
        self.catalog = catalog
        self.search = search
        self._written_at = time.monotonic()

    def maybe_write(self, force: bool = False) -> Future | None:
        if not self.catalog.changed:
            return None
        if not force and time.monotonic() - self._written_at < SNAPSHOT_INTERVAL_S:
            return None
        self.catalog.changed, self._written_at = False, time.monotonic()
        records = [r for r in self.catalog.index.records() if r.embedding is not None]
        root, embedder_id = self.root, self.search.discovery.embedder_id

        def write():  # on the discovery thread: entries are built there too
            now = time.monotonic()
            write_snapshot(
                root,
                [
                    SnapshotEntry(
                        r.key.namespace,
                        r.key.donor_id,
                        r.embedding,
                        r.fingerprint,
                        r.hits,
                        now - r.last_used,
                        r.deviation_reports,
                        r.deviation,
                        r.demoted,
                    )
                    for r in records
                ],
                embedder_id,
            )

        return self.search.discovery.write_snapshot(write)


def _mtime(path: Path) -> float:
    """Oldest first; a file gone since the listing (another instance evicted it) sorts first
    and is skipped as unreadable."""
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0
