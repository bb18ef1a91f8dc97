"""How a donor is addressed: its ``DonorKey`` (namespace and id), the id derived from its tokens
(``donor_id_for``), and the chain hashes of its blocks (``block_hashes``) that exact-prefix
matching compares.

The chain hash of block i covers tokens [0, (i+1) * block_size), so the longest run of equal
hashes is the longest block-aligned common prefix.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class DonorKey:
    """A donor is addressed by its namespace (the requests' ``cache_salt``, "" when none) and id."""

    namespace: str
    donor_id: str


def donor_id_for(namespace: str, token_ids: Sequence[int]) -> str:
    ns = namespace.encode()
    h = hashlib.blake2b(digest_size=16)
    # length-prefixed: a namespace holds a client's cache_salt, which may end in NULs and bytes
    # that read as tokens
    h.update(len(ns).to_bytes(8, "little"))
    h.update(ns)
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.hexdigest()


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """Chain hashes of each full block of ``token_ids``."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    out: list[bytes] = []
    prev = b""
    for i in range(len(tokens) // block_size):
        prev = hashlib.blake2b(
            prev + tokens[i * block_size : (i + 1) * block_size].tobytes(), digest_size=16
        ).digest()
        out.append(prev)
    return out
