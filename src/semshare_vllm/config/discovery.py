"""The discovery section: finding a donor for a new prompt."""

from __future__ import annotations

from dataclasses import dataclass

from semshare_vllm.config.knobs import Section, knob


@dataclass(frozen=True)
class DiscoveryConfig(Section):
    """How a new prompt's donors are found (embedding, similarity search, its deadline) and how
    long a match must be to be worth loading."""

    TITLE = "Donor discovery"

    min_reuse_tokens: int = knob(
        32,
        "Smallest claim worth loading; shorter matches are computed. Claims are also "
        "rounded down to whole KV blocks. Prompts shorter than this are not searched for "
        "semantic donors either.",
        minimum=1,
    )

    embedder: str = knob(
        "onnx",
        'How prompts are embedded for semantic donor search: "onnx" (MiniLM on ONNX '
        "Runtime, exported once into the cache dir; CUDA provider with onnxruntime-gpu), "
        '"sentence-transformers" (the same model on torch, fp16 on a GPU), or "none" '
        "(exact-prefix reuse only).",
        choices=("onnx", "sentence-transformers", "none"),
    )
    embedder_device: str = knob(
        "auto",
        'Where the embedder runs: "auto" (the GPU when there is one), "cpu", "cuda".',
        choices=("auto", "cpu", "cuda"),
    )
    similarity_threshold: float = knob(
        0.7,
        "Smallest cosine similarity of two prompts' embeddings for a donor to be a "
        "candidate. On real text (benchmarks/discovery_quality.py): 0.7 keeps every "
        "same-document pair (other instruction, reordered passages) and 93% of those with 30% "
        "of sentences replaced or deleted, and gives 3% of unrelated prompts a donor (0.6: 9%).",
        minimum=-1.0,
        maximum=1.0,
    )
    top_k: int = knob(4, "Candidates returned by a donor search (best first).", minimum=1)
    lookup_min_shared_grams: float = knob(
        0.05,
        "A donor search embeds the prompt only if some donor of its namespace shares at "
        "least this share of its (sampled) token 4-grams; otherwise it is a miss at once "
        "(counted as lookups_without_shared_grams). A hit needs most of its claim aligned to "
        "the same tokens (min_alignment_coverage), which a donor sharing almost no 4-gram cannot "
        "give: on real text unrelated documents share at most 1.5%, a document with half its "
        "words replaced 15%. (A donor holding half of them is a candidate without an "
        "embedding.) 0: no donor is ruled out this way.",
        minimum=0.0,
        maximum=1.0,
    )
    lookup_deadline_ms: int = knob(
        200,
        "How long a new request may wait for its donor search (vLLM re-asks; the request "
        "is not scheduled meanwhile). Past it, the request proceeds without a semantic donor "
        "(counted as lookup_timeouts). A request never waits when its namespace has no donors "
        "or the exact prefix already covers it. A prompt too long to embed within it (at the "
        "embedder's measured speed) is not embedded for its search (counted as "
        "lookups_too_long_to_embed).",
        minimum=0,
    )
    index_kind: str = knob(
        "auto",
        'Donor search: "exact" (numpy), "faiss-flat" (exact, FAISS; same '
        'results), "faiss-ivf" (approximate, for very large namespaces), "auto" (exact up '
        "to exact_search_max donors per namespace, faiss-ivf beyond; built on the discovery "
        "thread). FAISS tables stay on the CPU (FAISS's GPU indexes cannot remove single "
        "entries).",
        choices=("auto", "exact", "faiss-flat", "faiss-ivf"),
    )
    exact_search_max: int = knob(
        20_000,
        'With index_kind "auto": namespaces with more donors are searched with FAISS IVF.',
        minimum=1,
    )
