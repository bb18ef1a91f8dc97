"""How well semantic discovery finds the donors of ``testbed.pairs``.

Discovery is only worth its cost if it finds the prompt a request could reuse and refuses the
prompts it could not. ``evaluate`` runs the real embedder and the real ``VectorIndex`` over the
pairs and negatives of ``testbed.pairs`` (all donors in one namespace, as a single tenant's server
would hold them); the benchmark ``benchmarks/discovery_quality.py`` and
``tests/unit/discovery/test_discovery_quality.py`` share it.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np

from semshare_vllm.testbed.pairs import Pair, group_of
from semshare_vllm.testbed.text import lee_documents, lee_similarity

NAMESPACE = ""


def lee_spearman(embedder) -> float:
    """Rank correlation of the embedder's cosine with the Lee corpus' human ratings over the
    1,225 distinct document pairs: does the vector's notion of "similar" match people's?"""
    from scipy.stats import spearmanr

    vectors = np.stack([e.vector for e in embedder.embed_many(lee_documents())])
    human = np.asarray(lee_similarity())
    upper = np.triu_indices(len(vectors), k=1)
    rho, _ = spearmanr((vectors @ vectors.T)[upper], human[upper])
    return float(rho)


@dataclass(frozen=True)
class Outcome:
    group: str  # "cross-instruction", "reordered", "edited@0.3" or "negative"
    true_key: int | None  # the target's own donor (None for a negative)
    top_key: int  # the index's best donor
    top_score: float  # its cosine
    true_score: float | None  # cosine to the own donor
    near_key: int | None  # best SimHash near-duplicate, if any


def recall_at_1(outcomes: list[Outcome], threshold: float) -> float:
    """Targets whose top-1 donor is their own and clears the threshold (a hit to serve)."""
    return _mean(o.top_key == o.true_key and o.top_score >= threshold for o in outcomes)


def false_donor_rate(outcomes: list[Outcome], threshold: float) -> float:
    """Negatives whose top-1 donor clears the threshold (a wrong donor would be offered)."""
    return _mean(o.top_score >= threshold for o in outcomes)


def _mean(flags) -> float:
    flags = list(flags)
    return sum(flags) / len(flags) if flags else float("nan")


def evaluate(
    embedder, pairs: list[Pair], negatives: list[str], threshold: float, tokenizer=None
) -> dict:
    """Index every distinct donor in one namespace, search each target and each negative, and
    summarise per group at ``threshold``.

    With ``tokenizer`` (a Hugging Face tokenizer of the served model), texts go through what the
    discovery service does to a prompt: tokenise, SimHash the ids, detokenise without special
    tokens, embed; the SimHash near-duplicate scan is reported too. Without it, the raw texts are
    embedded and the scan is skipped."""
    from semshare_vllm.discovery.service import NEAR_DUPLICATE_BITS
    from semshare_vllm.discovery.simhash import simhash
    from semshare_vllm.discovery.vector_index import VectorIndex

    donors = list(dict.fromkeys(p.donor for p in pairs))
    key_of = {d: k for k, d in enumerate(donors)}
    texts = donors + [p.target for p in pairs] + list(negatives)
    if tokenizer is not None:
        ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        fingerprints = [simhash(i) for i in ids]
        texts = tokenizer.batch_decode(ids, skip_special_tokens=True)
    else:
        fingerprints = [0] * len(texts)
    t0 = time.perf_counter()
    vectors = [e.vector for e in embedder.embed_many(texts)]
    embed_s = time.perf_counter() - t0

    index = VectorIndex(dim=len(vectors[0]), kind="exact")
    for k in range(len(donors)):
        index.add(NAMESPACE, k, vectors[k], fingerprints[k])

    queries = [(group_of(p), key_of[p.donor]) for p in pairs] + [("negative", None)] * len(
        negatives
    )  # in the order of texts after donors
    outcomes = []
    for j, (group, true_key) in enumerate(queries, start=len(donors)):
        top = index.search(NAMESPACE, vectors[j], k=1)[0]
        near = (
            index.near_duplicates(NAMESPACE, fingerprints[j], NEAR_DUPLICATE_BITS)
            if tokenizer is not None
            else []
        )
        true_score = None if true_key is None else float(vectors[j] @ vectors[true_key])
        outcomes.append(
            Outcome(group, true_key, top.key, top.score, true_score, near[0].key if near else None)
        )

    groups = {}
    for name in dict.fromkeys(o.group for o in outcomes if o.group != "negative"):
        mine = [o for o in outcomes if o.group == name]
        cos = [o.true_score for o in mine]
        near = [o for o in mine if o.near_key is not None]
        groups[name] = {
            "n": len(mine),
            "recall": recall_at_1(mine, threshold),
            "mean_cos": statistics.fmean(cos),
            "median_cos": statistics.median(cos),
            "min_cos": min(cos),
            "simhash_matches": len(near),
            "simhash_correct": sum(o.near_key == o.true_key for o in near),
        }
    neg = [o for o in outcomes if o.group == "negative"]
    top = np.asarray([o.top_score for o in neg])
    return {
        "threshold": threshold,
        "donors": len(donors),
        "texts": len(texts),
        "embed_s": embed_s,
        "groups": groups,
        "outcomes": outcomes,
        "negatives": {
            "n": len(neg),
            "false_donor_rate": false_donor_rate(neg, threshold),
            "median_top": float(np.median(top)) if len(top) else float("nan"),
            "p95_top": float(np.percentile(top, 95)) if len(top) else float("nan"),
            "max_top": float(top.max()) if len(top) else float("nan"),
            "simhash_matches": sum(o.near_key is not None for o in neg),
        },
    }
