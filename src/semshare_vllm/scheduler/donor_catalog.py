"""The scheduler's donors: the donor index (changed only on the scheduler thread), the donors the
worker must drop at its next step, and whether anything changed since the last snapshot."""

from __future__ import annotations

from semshare_vllm.catalog.donor_index import DonorIndex, DonorRecord
from semshare_vllm.core.counters import StatsRecorder
from semshare_vllm.core.keys import DonorKey

# One prompt that needs more than the repair can be an unlucky one (it alone loses the donor:
# ``DonorRecord.withheld``); a donor that two prompts found short is demoted.
PROMPTS_TO_DEMOTE = 2


class DonorCatalog:
    def __init__(self, index: DonorIndex, stats: StatsRecorder):
        self.index = index
        self.stats = stats
        self.changed = False  # a snapshot of the embeddings is due
        self._evictions: list[DonorKey] = []  # for the worker's next step

    def add(self, record: DonorRecord) -> bool:
        """Index the donor, evicting others past capacity; False when it is larger than the
        whole store (not kept)."""
        evicted = self.index.add(record)
        if record.key in evicted:
            return False
        self.evict(evicted)
        return True

    def evict(self, keys: list[DonorKey]) -> None:
        if keys:
            self._evictions.extend(keys)
            self.stats.add("donors_evicted", len(keys))
            self.changed = True

    def clear(self, drop_files: bool = True) -> int:
        """Forget every donor; how many. ``drop_files``: the worker drops them all, files
        included (else they stay where they are, for the engines whose donors they are)."""
        keys = [record.key for record in self.index.records()]
        for key in keys:
            self.index.remove(key)
        if drop_files:
            self.evict(keys)
        return len(keys)

    def drop_bad(self, key: DonorKey) -> None:
        """A donor the worker found unusable: forgotten here, dropped there."""
        if self.index.remove(key) is not None:
            self.stats.add("donors_evicted")
        self._evictions.append(key)

    def report_deviation(self, key: DonorKey, deviation: float) -> None:
        """The recompute stage's measured deviation (0-1) of one reuse of donor ``key``."""
        self.evict(self.index.report_deviation(key, deviation))
        self.changed = True

    def report_escalation(self, key: DonorKey, target: int | None, declined: bool) -> None:
        """A load from donor ``key`` into ``target`` (``Served.target``) needed the recompute
        gate's escalation, or was declined: the donor is withheld from that prompt while this
        process keeps its record (``DonorRecord.withheld``), and once ``PROMPTS_TO_DEMOTE``
        prompts needed it, demoted (no longer offered by discovery; the ``divergence`` eviction
        policy evicts it first). One prompt counts once: its copies served before the first
        one's figures came back, and a request scoring its continuation (semshare-bench's
        scoring request), are that prompt again, not more evidence against the donor."""
        record = self.index.get(key)
        if record is None or record.demoted:
            return
        if target is not None:
            if target in record.withheld_from:
                # a copy, or a scoring request, declined: withheld from its scoring too
                record.withheld_from[target] |= declined
                return
            record.withheld_from[target] = declined
            self.stats.add("prompts_withheld_a_donor")
        record.escalations += 1
        if record.escalations >= PROMPTS_TO_DEMOTE:
            self.index.demote(key)
            self.stats.add("donors_demoted_by_escalation")
            self.changed = True

    def set_embedding(self, key: DonorKey, serial: int, embedding, fingerprint: int) -> bool:
        """Make the donor searchable (False: that registration is gone meanwhile)."""
        if self.index.set_embedding(key, serial, embedding, fingerprint):
            self.stats.add("donors_embedded")
            self.changed = True
            return True
        return False

    def take_evictions(self) -> list[DonorKey]:
        evictions, self._evictions = self._evictions, []
        return evictions
