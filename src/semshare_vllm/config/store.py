"""The donor store section: capture, the host pool, persistence, eviction."""

from __future__ import annotations

from dataclasses import dataclass

from semshare_vllm.config.knobs import Section, knob


@dataclass(frozen=True)
class StoreConfig(Section):
    """Which finished requests become donors, where their KV is kept on this instance (the host
    pool, a directory) and which donor leaves when the pool is full."""

    TITLE = "Donor store and capture"

    host_store_bytes: int = knob(
        4 * 2**30,
        "Host-memory pool for donor KV, per tensor-parallel rank, allocated at start-up. Least "
        'recently used donors are evicted past it. Integer bytes or a string such as "8GiB". '
        "Lowered at start-up, with a warning, to half the host memory then available (on CPU, "
        "vLLM gives its own KV cache most of RAM unless VLLM_CPU_KVCACHE_SPACE is set).",
        minimum=0,
        size=True,
    )
    persist_dir: str | None = knob(
        None,
        "Directory where donors are also written (atomically: temp file, fsync, rename) and "
        "found again after a restart. Unset: memory only. Corrupt or truncated files are skipped "
        "with a warning; partial files a killed writer left are removed at start-up (counted as "
        "persisted_incomplete). Writes waiting for a slow disk hold at most a quarter of "
        "host_store_bytes; donors past that stay memory-only (persist_backlog_skipped). Donors "
        "are kept apart by an engine fingerprint (weights and model code, their configuration "
        "and quantisation files, load format and loader options, the model config in effect, "
        "quantisation, dtypes, max_model_len, multimodal settings, the draft model, block size, "
        "parallel layout, vLLM version: docs/architecture.md); an engine whose weights cannot "
        "be told from others (load_format 'dummy', a tensorizer URI, weights streamed from a "
        "URL or another process, a hub id with no snapshot in vLLM's cache), or whose model "
        "files changed while it started, persists and shares nothing, with one warning; so "
        "does an engine after vLLM reset its connector "
        "(its pause and sleep do, around weight updates), which also deletes the files.",
    )
    capture: bool = knob(True, "Capture the KV of finished requests as donors.")
    min_donor_tokens: int = knob(
        32, "Requests with fewer computed tokens than this are not captured.", minimum=1
    )
    eviction_policy: str = knob(
        "lru",
        'Which donor leaves when the store is full: "lru" (least recently used), '
        '"decay" (LLMCache\'s staleness decay: (1 + hits) halved per decay_half_life_s idle; '
        'lowest first), "divergence" (donors whose reuses measured high deviation are '
        "demoted, i.e. no longer offered, and evicted first; then LRU).",
        choices=("lru", "decay", "divergence"),
    )
    decay_half_life_s: float = knob(
        3600.0,
        'With eviction_policy "decay": a donor\'s hit count halves in value after '
        "this many seconds unused.",
        minimum=1e-3,
    )
    divergence_threshold: float = knob(
        0.3,
        'With eviction_policy "divergence": measured deviation (0-1; a moving average '
        "over the donor's reuses, the latest weighing half; from its 3rd reuse on) above which "
        "a donor is demoted (no longer offered); reported high again, it is evicted.",
        minimum=0.0,
        maximum=1.0,
    )
