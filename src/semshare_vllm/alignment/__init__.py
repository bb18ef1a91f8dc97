"""Token alignment: which donor token each target token takes its KV from.

The entry is ``align(target_ids, donor_ids, params, table, splitter) -> Alignment`` (align.py).
One concept per file: ``result.py`` (the ``Alignment`` value), ``exact_runs.py`` (token-identical
runs at any offset), ``edits.py`` (edit alignment of the gaps, rapidfuzz), ``sentences.py``
(sentence units), ``echoes.py`` (aligned tokens echoing the unshared text, ``with_echoes``),
``lsh.py`` (SemShareKV's LSH on RoPE-rotated input embeddings, and its
prompt similarity score), ``embedding_table.py`` (the input embeddings, read from safetensors).
"""

from semshare_vllm.alignment.align import AlignParams, DonorFeatures, align
from semshare_vllm.alignment.echoes import with_echoes
from semshare_vllm.alignment.embedding_table import EmbeddingTable, EmbeddingUnavailable
from semshare_vllm.alignment.lsh import LshParams, lsh_similarity
from semshare_vllm.alignment.result import Alignment, MatchKind, Run
from semshare_vllm.alignment.sentences import SentenceSplitter

__all__ = [
    "AlignParams",
    "Alignment",
    "DonorFeatures",
    "EmbeddingTable",
    "EmbeddingUnavailable",
    "LshParams",
    "MatchKind",
    "Run",
    "SentenceSplitter",
    "align",
    "lsh_similarity",
    "with_echoes",
]
