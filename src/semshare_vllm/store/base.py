"""Where donor KV is kept: one interface for the built-in host store (``host_store.py``) and
LMCache (``lmcache_store.py``).

KV crosses this interface as *rows*: ``[layers, tokens, kv_heads, 2 * head_size]``, K then V in
the last dimension, one row per donor token: the staging layout the kernels read and write
(``kernels.stage_rows`` / ``kernels.gather_rearrange``). Each store converts to its own format
once, vectorised. A donor is addressed by its ``DonorKey`` and its own token ids (a prefix from
position 0, which is what LMCache's chained chunk keys are made of); a store may use either.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Sequence

import torch

from semshare_vllm.core.keys import DonorKey


class DonorUnavailable(RuntimeError):
    """The donor is neither in memory nor readable from disk."""


class DonorNotReadNow(DonorUnavailable):
    """The donor's disk or remote did not answer in time (``core/stall_guard.py``): this load
    is recomputed, but the donor is kept and read again later."""


class DonorKVStore(ABC):
    name: str = "?"

    @abstractmethod
    def put(self, key: DonorKey, token_ids: Sequence[int], rows: torch.Tensor) -> bool:
        """Keep the donor's KV: ``rows[:, i]`` belongs to ``token_ids[i]``. True once it is
        kept (for a store shared across instances: readable by them). A store that cannot keep
        it (full, unreachable) returns False and says why in its log, never by raising."""

    @abstractmethod
    def get(
        self, key: DonorKey, token_ids: Sequence[int], start: int = 0, end: int | None = None
    ) -> torch.Tensor | None:
        """Rows ``[start, end)`` of the donor (``end``: its last token), or None when the store
        does not hold all of them."""

    def close(self) -> None:  # noqa: B027 (optional: stores holding nothing need not)
        """Release what the store holds (threads, connections, memory)."""
