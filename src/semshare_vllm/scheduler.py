"""The scheduler half (EngineCore process): decides what to claim, what to capture, what to evict.

Hit path today (exact prefix): find the donor of the request's namespace that shares the longest
block-aligned prefix beyond vLLM's own prefix cache, claim it (leaving at least one token to
compute), and tell the worker which donor tokens go into which blocks.

Capture: when a request finishes, keep its blocks (``delay_free``) until the worker has copied
its KV into the host store and reported the request in ``finished_sending``.
"""

from __future__ import annotations

import logging
from pathlib import Path

from semshare_vllm import donor_file
from semshare_vllm.config import SemShareConfig
from semshare_vllm.donor_index import (
    DonorIndex,
    DonorRecord,
    PrefixMatch,
    block_hashes,
    donor_id_for,
)
from semshare_vllm.geometry import KVGeometry
from semshare_vllm.metadata import (
    CaptureSpec,
    DonorKey,
    LoadSpec,
    SemShareConnectorMetadata,
    SemShareWorkerMetadata,
)
from semshare_vllm.stats import StatsRecorder

logger = logging.getLogger("vllm.semshare.scheduler")


def namespace_of(request) -> str:
    return request.cache_salt or ""


class SemShareScheduler:
    def __init__(self, config: SemShareConfig, geometry: KVGeometry):
        self.config = config
        self.geometry = geometry
        self.stats = StatsRecorder()
        # The worker's pool reports its real size in its first step (update_connector_output).
        self.index = DonorIndex(geometry.block_size, config.host_store_bytes)
        self._matches: dict[str, PrefixMatch] = {}     # req_id -> match offered this step
        self._loads: list[LoadSpec] = []
        self._captures: list[CaptureSpec] = []
        self._evictions: list[DonorKey] = []
        self._capturing: set[str] = set()               # req ids whose blocks we hold
        self._looked_up: set[str] = set()               # live req ids already counted
        self._faults_logged: set[str] = set()
        if geometry.unsupported:
            logger.warning("SemShare disabled for this model: %s; requests are computed as usual",
                           geometry.unsupported)
        elif config.persist_dir:
            self._restore(Path(config.persist_dir) / geometry.fingerprint)

    # ---- hit path -----------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        try:
            return self._match(request, num_computed_tokens)
        except Exception:  # a connector fault costs this request its reuse, nothing more
            self._fault("lookup")
            return 0, False

    def _match(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        self._matches.pop(request.request_id, None)
        if self.geometry.unsupported:
            return 0, False
        bs = self.geometry.block_size
        if request.request_id not in self._looked_up:  # vLLM re-asks while it cannot schedule
            self._looked_up.add(request.request_id)
            self.stats.add("lookups")
            self.stats.add("lookup_tokens", request.num_tokens - num_computed_tokens)
        match = self.index.longest_prefix(namespace_of(request), request.all_token_ids)
        if match is None:
            return 0, False
        # vLLM must compute at least one token itself, and our claims end on a block boundary.
        limit = ((request.num_tokens - 1) // bs) * bs
        end = min(match.num_tokens, limit)
        claim = end - num_computed_tokens
        if claim < max(self.config.min_reuse_tokens, 1):
            return 0, False
        self._matches[request.request_id] = PrefixMatch(match.key, end)
        return claim, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        match = self._matches.pop(request.request_id, None)
        if num_external_tokens == 0 or match is None:
            return
        start = match.num_tokens - num_external_tokens
        self._loads.append(LoadSpec(
            req_id=request.request_id, key=match.key, src_start=start, dst_start=start,
            num_tokens=num_external_tokens, block_ids=list(blocks.get_block_ids()[0])))
        self.index.touch(match.key)
        record = self.index.get(match.key)
        if record is not None:
            record.hits += 1
        self.stats.add("hits")
        self.stats.add("hit_tokens", num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> SemShareConnectorMetadata:
        meta = SemShareConnectorMetadata(evictions=self._evictions, captures=self._captures,
                                         loads=self._loads)
        self._evictions, self._captures, self._loads = [], [], []
        self._matches.clear()
        return meta

    # ---- capture ------------------------------------------------------------------------------
    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict | None]:
        self._looked_up.discard(request.request_id)
        try:
            return self._capture_on_finish(request, block_ids)
        except Exception:  # nothing was queued before the fault: vLLM frees the blocks now
            self._fault("capture")
            return False, None

    def _fault(self, where: str) -> None:
        self.stats.add("fallbacks")
        if where not in self._faults_logged:
            self._faults_logged.add(where)
            logger.exception("SemShare: %s failed; the request is computed as usual (logged "
                             "once, counted in stats as fallbacks)", where)

    def _capture_on_finish(self, request, block_ids: list[int]) -> tuple[bool, dict | None]:
        if not self.config.capture or self.geometry.unsupported:
            return False, None
        # The KV of the last token is never computed (it was just sampled); with async
        # scheduling num_computed_tokens may already count it.
        n = min(request.num_computed_tokens, request.num_tokens - 1)
        if n < self.config.min_donor_tokens:
            return False, None
        namespace = namespace_of(request)
        token_ids = list(request.all_token_ids[:n])
        if self.index.covers(namespace, token_ids):
            return False, None
        bs = self.geometry.block_size
        blocks = list(block_ids[: (n + bs - 1) // bs])
        if len(blocks) * bs < n:  # should not happen; never read blocks we do not hold
            return False, None
        key = DonorKey(namespace, donor_id_for(namespace, token_ids))
        record = DonorRecord(key, token_ids, self.geometry.donor_bytes(n),
                             block_hashes(token_ids, bs))
        evicted = self.index.add(record)
        if key in evicted:  # larger than the whole store
            return False, None
        self._evict(evicted)
        self._captures.append(CaptureSpec(request.request_id, key, token_ids, blocks))
        self._capturing.add(request.request_id)
        self.stats.add("donors_registered")
        return True, None

    def has_pending_block_frees(self) -> bool:
        return bool(self._capturing)

    def update_connector_output(self, connector_output) -> None:
        for req_id in connector_output.finished_sending or ():
            self._capturing.discard(req_id)
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, SemShareWorkerMetadata):
            if meta.capacity_bytes is not None:
                self._evict(self.index.shrink(meta.capacity_bytes))
            for key in meta.bad_donors:
                if self.index.remove(key) is not None:
                    self.stats.add("donors_evicted")
                self._evictions.append(key)

    def _evict(self, keys: list[DonorKey]) -> None:
        if keys:
            self._evictions.extend(keys)
            self.stats.add("donors_evicted", len(keys))

    # ---- persistence --------------------------------------------------------------------------
    def _restore(self, root: Path) -> None:
        """Index the donors persisted under ``root`` (headers only; data is checked on load)."""
        if not root.is_dir():
            return
        tp = self.geometry.tp_size
        files = sorted(root.glob(f"*.tp0of{tp}{donor_file.SUFFIX}"), key=lambda p: p.stat().st_mtime)
        for path in files:
            try:
                header = donor_file.read_header(path)
                for rank in range(1, tp):
                    donor_file.read_header(donor_file.donor_path(root, header.donor_id, rank, tp))
                if (donor_id_for(header.namespace, header.token_ids) != header.donor_id
                        or list(self.geometry.layer_names) != header.layer_names):
                    raise donor_file.CorruptDonorFile(f"{path}: identity does not match contents")
            except donor_file.CorruptDonorFile as exc:
                logger.warning("SemShare: skipping persisted donor: %s", exc)
                self.stats.add("persisted_skipped")
                continue
            key = DonorKey(header.namespace, header.donor_id)
            n = len(header.token_ids)
            self._evict(self.index.add(DonorRecord(
                key, header.token_ids, self.geometry.donor_bytes(n),
                block_hashes(header.token_ids, self.geometry.block_size))))
            self.stats.add("donors_restored")
        if len(self.index):
            logger.info("SemShare: restored %d donors from %s", len(self.index), root)
