"""Discovery snapshot entries, built the same from a seed in the test and in the writer process
it kills (``test_snapshot.py``)."""

import numpy as np

from semshare_vllm.discovery.embedder import DocumentEmbedding
from semshare_vllm.discovery.snapshot import SnapshotEntry


def entries(n, dim=384, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        segs = rng.standard_normal((1 + i % 3, dim)).astype(np.float32)
        vec = segs.mean(0) / np.linalg.norm(segs.mean(0))
        out.append(
            SnapshotEntry(
                f"ns{i % 2}",
                f"donor{i}",
                DocumentEmbedding(vec, segs, 100 + i),
                (2**64 - 1) - i,
                hits=i,
                idle_s=1.5 * i,
                deviation_reports=i % 4,
                deviation=0.1 * (i % 4),
                demoted=i == 3,
            )
        )
    return out
