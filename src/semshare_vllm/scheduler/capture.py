"""Which finished requests become donors: the ``DonorRecord`` for the catalog and the
``CaptureSpec`` that has the worker copy its KV out of the blocks vLLM keeps for us
(``delay_free``) until the worker reports it in ``finished_sending``."""

from __future__ import annotations

from semshare_vllm.catalog.donor_index import DonorIndex, DonorRecord
from semshare_vllm.config import SemShareConfig
from semshare_vllm.core.identity import keyable, namespace_of
from semshare_vllm.core.keys import DonorKey, block_hashes, donor_id_for
from semshare_vllm.layout.geometry import KVGeometry
from semshare_vllm.metadata import CaptureSpec
from semshare_vllm.scheduler.request_params import reuse_limit, reuse_mode


def donor_for(
    request, block_ids: list[int], index: DonorIndex, config: SemShareConfig, geometry: KVGeometry
) -> tuple[DonorRecord, CaptureSpec] | None:
    """The donor a finished request makes, or None (opted out, too short, already covered)."""
    if (
        not config.capture
        or geometry.unsupported
        or reuse_mode(request) == "off"
        or not keyable(request)
    ):
        return None
    # The KV of the last token is never computed (it was just sampled); with async scheduling
    # num_computed_tokens may already count it.
    n = min(request.num_computed_tokens, request.num_tokens - 1)
    limit = reuse_limit(request)
    if limit is not None:  # the prompt as if it ended there, as it was searched and aligned
        n = min(n, limit + 1)
    if n < config.min_donor_tokens:
        return None
    namespace = namespace_of(request)
    token_ids = list(request.all_token_ids[:n])
    if index.covers(namespace, token_ids):
        return None
    bs = geometry.block_size
    blocks = list(block_ids[: (n + bs - 1) // bs])
    if len(blocks) * bs < n:  # should not happen; never read blocks we do not hold
        return None
    key = DonorKey(namespace, donor_id_for(namespace, token_ids))
    record = DonorRecord(
        key,
        token_ids,
        geometry.donor_bytes(n),
        block_hashes(token_ids, bs),
        num_prompt_tokens=min(request.num_prompt_tokens, n),
    )
    return record, CaptureSpec(request.request_id, key, token_ids, blocks, record.num_prompt_tokens)
