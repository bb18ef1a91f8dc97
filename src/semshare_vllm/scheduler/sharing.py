"""Donors across instances (``shared_index_url``): each donor captured here is announced on the
shared index (``catalog/shared_index.py``) with its embedding, from the discovery thread once it
is embedded; the donors other instances announce (once their KV is readable) join this catalog,
and the worker loads them through the LMCache tier on first use."""

from __future__ import annotations

import logging

from semshare_vllm.catalog.donor_index import DonorRecord
from semshare_vllm.catalog.shared_index import SharedDonorFeed
from semshare_vllm.catalog.shared_records import SharedDonor
from semshare_vllm.core.counters import StatsRecorder
from semshare_vllm.core.keys import DonorKey, block_hashes, donor_id_for
from semshare_vllm.layout.geometry import KVGeometry
from semshare_vllm.logs import warn_once
from semshare_vllm.scheduler.donor_catalog import DonorCatalog
from semshare_vllm.scheduler.semantic_search import SemanticSearch

logger = logging.getLogger("vllm.semshare.scheduler")


class DonorSharing:
    def __init__(
        self,
        feed: SharedDonorFeed | None,
        geometry: KVGeometry,
        catalog: DonorCatalog,
        search: SemanticSearch | None,
        stats: StatsRecorder,
    ):
        self.feed = feed
        self.geometry = geometry
        self.catalog = catalog
        self.search = search
        self.stats = stats

    def announce(self, record: DonorRecord) -> None:
        """Embed a donor captured here and, with a shared index, publish it: once embedded, from
        the discovery thread (nothing waits for vLLM to step); at once without discovery.
        Readers wait for its KV themselves."""
        search = self.search
        if self.feed is None:
            if search is not None:
                search.embed_donor(record)
            return
        feed, key, tp_size = self.feed, record.key, self.geometry.tp_size

        def shared() -> SharedDonor:  # made when published: no copy of the tokens waits
            return SharedDonor(
                key.namespace,
                key.donor_id,
                list(record.token_ids),
                len(record.prompt_token_ids),
                tp_size,
            )

        if search is None or search.discovery.failed:
            feed.publish(shared())
            return
        embedder_id = search.discovery.embedder_id

        def with_embedding(embedded) -> None:
            donor = shared()
            donor.embedder_id = embedder_id
            donor.embedding, donor.fingerprint = embedded.embedding, embedded.fingerprint
            feed.publish(donor)

        # Published even when the embedding never comes: other instances embed it themselves.
        # The closures keep the record (its tokens) alive while it waits: counted as held.
        search.embed_donor(
            record,
            with_embedding,
            holds_tokens=len(record.token_ids),
            on_drop=lambda: feed.publish(shared()),
        )

    def stop(self) -> None:
        """Neither publish nor take shared donors any more (a connector reset)."""
        feed, self.feed = self.feed, None
        if feed is not None:
            feed.close(timeout_s=1.0)  # (on the engine-core thread: never wait long)

    def absorb(self) -> None:
        """Add the donors other instances announced (on the scheduler thread, which owns the
        catalog)."""
        if self.feed is None:
            return
        for shared in self.feed.take_arrived():
            try:
                self._add(shared)
            except Exception as exc:  # a malformed record costs that record, nothing more
                self.stats.add("shared_records_dropped")
                warn_once(
                    logger,
                    "shared_record",
                    "SemShare: a shared donor record was not usable: %s",
                    exc,
                )

    def _add(self, shared: SharedDonor) -> None:
        key = DonorKey(shared.namespace, shared.donor_id)
        tokens = shared.token_ids
        if not tokens or donor_id_for(shared.namespace, tokens) != shared.donor_id:
            self.stats.add("shared_records_dropped")  # not what its id says it is
            return
        if len(shared.kv_digests) != self.geometry.tp_size:
            self.stats.add("shared_records_dropped")  # its KV could not be checked on fetch
            return
        index = self.catalog.index
        if key in index or index.covers(shared.namespace, tokens):
            return
        n = len(tokens)
        record = DonorRecord(
            key,
            tokens,
            self.geometry.donor_bytes(n),
            block_hashes(tokens, self.geometry.block_size),
            num_prompt_tokens=min(max(shared.num_prompt_tokens, 1), n),
            kv_digests=list(shared.kv_digests),
        )
        if not self.catalog.add(record):
            return
        self.stats.add("donors_shared_in")
        search = self.search
        if search is None:
            return
        if shared.embedding is None or shared.embedder_id != search.discovery.embedder_id:
            search.embed_donor(record)  # embedded here, as a donor captured here would be
        elif self.catalog.set_embedding(key, record.serial, shared.embedding, shared.fingerprint):
            search.prepare_alignment(record)
