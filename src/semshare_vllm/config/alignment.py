"""The alignment section: target token -> donor token, in stages."""

from __future__ import annotations

from dataclasses import dataclass

from semshare_vllm.config.knobs import Section, SemShareConfigError, knob

ALIGN_STAGES = ("exact", "edit", "sentence", "lsh")
LSH_ROPE_STYLES = ("neox", "gptj", "none")


def check_lsh(bits: int, tables: int, rope_style: str) -> None:
    """The LSH rules, for the config's keys and for ``alignment.lsh.LshParams`` built directly:
    codes are packed into bytes, and the RoPE pairing is one the LSH stage knows."""
    if bits < 1 or tables < 1:
        raise SemShareConfigError(f"lsh_bits and lsh_tables: must be >= 1; got {bits} * {tables}")
    if (bits * tables) % 8:
        raise SemShareConfigError(
            f"lsh_bits * lsh_tables must be a multiple of 8; got {bits} * {tables}"
        )
    if rope_style not in LSH_ROPE_STYLES:
        raise SemShareConfigError(
            f"lsh_rope_style: must be one of {', '.join(LSH_ROPE_STYLES)}; got {rope_style!r}"
        )


@dataclass(frozen=True)
class AlignmentConfig(Section):
    """How a target prompt's tokens are matched to a donor's tokens (exact runs, edits, sentences,
    LSH) and how much of a claim must be matched for the donor's KV to be used."""

    TITLE = "Token alignment (target token -> donor token)"

    align_stages: str = knob(
        "exact,edit,sentence,lsh",
        'Alignment stages, in order, comma-separated: "exact" '
        '(token-identical runs at any offset), "edit" (edit-align the gaps between runs), '
        '"sentence" (pair reworded or moved sentences), "lsh" (SemShareKV\'s nearest '
        'token by LSH on RoPE-rotated input embeddings). "lsh" alone is the paper\'s '
        "matching.",
    )
    align_min_run: int = knob(16, "Shortest token-identical run the exact stage takes.", minimum=2)
    align_sentence_snap: int = knob(
        4,
        "A run spilling at most this many tokens across a sentence boundary is cut there "
        "(0: never).",
        minimum=0,
    )
    edit_min_similarity: float = knob(
        0.3,
        "Edit and sentence stages: smallest normalised Levenshtein similarity of two token "
        "spans (rapidfuzz) for them to be edit-aligned; below it the pre-check skips them.",
        minimum=0.0,
        maximum=1.0,
    )
    sentence_min_similarity: float = knob(
        0.8,
        "Sentence stage: smallest cosine of two sentences' vectors (mean input embedding "
        "with the vocabulary's mean and top 10 principal directions removed) for them to be "
        "paired. Measured on SmolLM2 and real text: sentences with 30% of their words replaced "
        "keep a median cosine of 0.88 with their original; an unrelated sentence's best match "
        "has a median of 0.65 (95th percentile 0.77).",
        minimum=-1.0,
        maximum=1.0,
    )
    lsh_bits: int = knob(
        32,
        "LSH stage: random hyperplanes per table (lsh_bits * lsh_tables must be a multiple "
        "of 8). The paper's distance normalisation (max 30) suggests ~32-bit codes; "
        "unconfirmed.",
        minimum=1,
    )
    lsh_tables: int = knob(
        2, "LSH stage: independent hyperplane tables; Hamming distances add up.", minimum=1
    )
    lsh_max_distance: float = knob(
        0.25,
        "LSH stage: largest fraction of differing code bits for a fuzzy match; farther "
        "tokens stay unaligned (computed).",
        minimum=0.0,
        maximum=1.0,
    )
    lsh_rope_style: str = knob(
        "neox",
        'LSH stage: RoPE pairing applied to input embeddings: "neox" (halves, as '
        "vLLM's Llama / Qwen / Mistral), \"gptj\" (adjacent pairs, the paper's eq. 1), "
        '"none".',
        choices=LSH_ROPE_STYLES,
    )
    lsh_rope_base: float = knob(
        0.0, "LSH stage: RoPE base for the embeddings; 0 = the model's rope_theta.", minimum=0.0
    )
    embedding_sketch_dim: int = knob(
        -1,
        "Input-embedding matrix kept by the scheduler for the sentence and LSH stages, "
        "read from the model's safetensors (only that tensor, once): -1 = whole up to 64M "
        "elements (SmolLM2: 28M), a 256-dim random projection beyond (a 7B model's 545M); "
        "0 = always whole; n = a projection to n dims.",
        minimum=-1,
    )

    min_alignment_coverage: float = knob(
        0.8,
        "Semantic hits: smallest share of the claimable tokens aligned to the same token "
        "of the donor for the donor's KV to be used (tokens aligned to another token carry KV "
        "no better than a random token's: they are recomputed and do not count); below it the "
        "request is computed instead (and kept as a donor). Measured with semshare-bench "
        "(2K-token doc-qa, CPU): hits whose same-token share was about 65% (threshold 0.5) or "
        "72% (threshold 0.7) recomputed about half of all token-layers and took 2.7-3.0 s "
        "against 2.9-3.2 s cold, and, served approximately, did not become donors for the "
        "prompts after them.",
        minimum=0.0,
        maximum=1.0,
    )

    def stages(self) -> tuple[str, ...]:
        """align_stages as a tuple, in order."""
        return tuple(x.strip() for x in self.align_stages.split(",") if x.strip())

    def validate(self) -> None:
        stages = self.stages()
        if any(x not in ALIGN_STAGES for x in stages) or len(set(stages)) != len(stages):
            raise SemShareConfigError(
                f"align_stages: a comma-separated subset of {', '.join(ALIGN_STAGES)} without "
                f"repeats; got {self.align_stages!r}"
            )
        check_lsh(self.lsh_bits, self.lsh_tables, self.lsh_rope_style)
