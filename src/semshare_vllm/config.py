"""The one typed config of the connector.

Built from ``kv_connector_extra_config`` (the JSON given to ``--kv-transfer-config``), then
overridden by ``SEMSHARE_<KEY>`` environment variables. Anything wrong (an unknown key, a wrong
type, a value out of range) raises one ``SemShareConfigError`` naming the key and what is allowed,
at start-up: never later, in a request.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

ENV_PREFIX = "SEMSHARE_"

_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


class SemShareConfigError(ValueError):
    """A bad configuration value; the message names the key."""


def _knob(default: Any, doc: str, *, minimum: float | None = None, maximum: float | None = None,
          size: bool = False, choices: tuple[str, ...] | None = None, secret: bool = False):
    # secret: never shown (repr, describe(), which the connector logs)
    return field(default=default, repr=not secret,
                 metadata={"doc": doc, "min": minimum, "max": maximum, "size": size,
                           "choices": choices, "secret": secret})


@dataclass(frozen=True)
class SemShareConfig:
    host_store_bytes: int = _knob(
        4 * 2**30,
        "Host-memory pool for donor KV, per tensor-parallel rank, allocated at start-up. Least "
        "recently used donors are evicted past it. Integer bytes or a string such as \"8GiB\". "
        "Lowered at start-up, with a warning, to half the host memory then available (on CPU, "
        "vLLM gives its own KV cache most of RAM unless VLLM_CPU_KVCACHE_SPACE is set).",
        minimum=0, size=True)
    persist_dir: str | None = _knob(
        None,
        "Directory where donors are also written (atomically: temp file, fsync, rename) and "
        "found again after a restart. Unset: memory only. Corrupt or truncated files are skipped "
        "with a warning; partial files a killed writer left are removed at start-up (counted as "
        "persisted_incomplete).")
    capture: bool = _knob(
        True, "Capture the KV of finished requests as donors.")
    min_donor_tokens: int = _knob(
        32, "Requests with fewer computed tokens than this are not captured.", minimum=1)
    min_reuse_tokens: int = _knob(
        32, "Smallest claim worth loading; shorter matches are computed. Claims are also "
        "rounded down to whole KV blocks. Prompts shorter than this are not searched for "
        "semantic donors either.", minimum=1)

    # ---- donor KV tier and sharing across instances -------------------------------------------
    kv_tier: str = _knob(
        "host", "Where donor KV lives besides the host store: \"host\" (the host store only, "
        "this instance), \"lmcache\" (every captured donor is also put in LMCache, pinned to "
        "0.5.6, the [lmcache] extra; a donor missing from the host store, such as another "
        "instance's or one the pool let go, is fetched from LMCache into the host store on use). "
        "If LMCache cannot be set up, the worker warns once and keeps the host store alone.",
        choices=("host", "lmcache"))
    lmcache_local_cpu_bytes: int = _knob(
        2 * 2**30, "With kv_tier \"lmcache\": LMCache's local CPU backend size, per rank "
        "(LMCache evicts LRU past it).",
        minimum=0, size=True)
    lmcache_remote_url: str | None = _knob(
        None, "With kv_tier \"lmcache\": LMCache's remote backend, e.g. "
        "\"redis://host:6379\" (Redis or Valkey; LMCache's other remote_url schemes pass "
        "through), shared by every instance. Unset: LMCache's local CPU backend only.")
    shared_index_url: str | None = _knob(
        None, "A Redis / Valkey URL (redis://, rediss://, unix://) where the donor index is "
        "shared across instances: each donor's record (namespace, token ids, embedding) is "
        "published to a stream, and every instance adds the others' donors to its own index "
        "once their KV is readable from lmcache_remote_url (catching up from the stream's start "
        "when it starts). Needs kv_tier \"lmcache\" and lmcache_remote_url (usually the same "
        "server). Unset: this instance's donors only.")
    shared_index_secret: str | None = _knob(
        None, "With shared_index_url (required there): the key every instance signs its donor "
        "records and KV readiness marks with (HMAC-SHA256); records or marks not signed with it "
        "are dropped (counted as shared_records_forged), and a shared donor's KV is checked "
        "against the digest its instance signed before it is used (else the load is recomputed, "
        "counted as tier_digest_mismatches). Give every instance the "
        "same long random value, preferably as SEMSHARE_SHARED_INDEX_SECRET (vLLM logs its "
        "arguments; this key is never logged here).", secret=True)

    # ---- donor discovery ----------------------------------------------------------------------
    embedder: str = _knob(
        "onnx", "How prompts are embedded for semantic donor search: \"onnx\" (MiniLM on ONNX "
        "Runtime, exported once into the cache dir; CUDA provider with onnxruntime-gpu), "
        "\"sentence-transformers\" (the same model on torch, fp16 on a GPU), or \"none\" "
        "(exact-prefix reuse only).",
        choices=("onnx", "sentence-transformers", "none"))
    embedder_device: str = _knob(
        "auto", "Where the embedder runs: \"auto\" (the GPU when there is one), \"cpu\", "
        "\"cuda\".", choices=("auto", "cpu", "cuda"))
    similarity_threshold: float = _knob(
        0.7, "Smallest cosine similarity of two prompts' embeddings for a donor to be a "
        "candidate. On real text (benchmarks/discovery_quality.py): 0.7 keeps every "
        "same-document pair (other instruction, reordered passages) and 93% of those with 30% "
        "of sentences replaced or deleted, and gives 3% of unrelated prompts a donor (0.6: 9%).",
        minimum=-1.0, maximum=1.0)
    top_k: int = _knob(
        4, "Candidates returned by a donor search (best first).", minimum=1)
    lookup_min_shared_grams: float = _knob(
        0.05, "A donor search embeds the prompt only if some donor of its namespace shares at "
        "least this share of its (sampled) token 4-grams; otherwise it is a miss at once "
        "(counted as lookups_without_shared_grams). A hit needs most of its claim aligned to "
        "the same tokens (min_alignment_coverage), which a donor sharing almost no 4-gram cannot "
        "give: on real text unrelated documents share at most 1.5%, a document with half its "
        "words replaced 15%. (A donor holding half of them is a candidate without an "
        "embedding.) 0: no donor is ruled out this way.", minimum=0.0, maximum=1.0)
    lookup_deadline_ms: int = _knob(
        200, "How long a new request may wait for its donor search (vLLM re-asks; the request "
        "is not scheduled meanwhile). Past it, the request proceeds without a semantic donor "
        "(counted as lookup_timeouts). A request never waits when its namespace has no donors "
        "or the exact prefix already covers it.",
        minimum=0)
    index_kind: str = _knob(
        "auto", "Donor search: \"exact\" (numpy), \"faiss-flat\" (exact, FAISS; same "
        "results), \"faiss-ivf\" (approximate, for very large namespaces), \"auto\" (exact up "
        "to exact_search_max donors per namespace, faiss-ivf beyond; built on the discovery "
        "thread). FAISS tables stay on the CPU (FAISS's GPU indexes cannot remove single "
        "entries).", choices=("auto", "exact", "faiss-flat", "faiss-ivf"))
    exact_search_max: int = _knob(
        20_000, "With index_kind \"auto\": namespaces with more donors are searched with FAISS "
        "IVF.", minimum=1)
    eviction_policy: str = _knob(
        "lru", "Which donor leaves when the store is full: \"lru\" (least recently used), "
        "\"decay\" (LLMCache's staleness decay: (1 + hits) halved per decay_half_life_s idle; "
        "lowest first), \"divergence\" (donors whose reuses measured high deviation are "
        "demoted, i.e. no longer offered, and evicted first; then LRU).",
        choices=("lru", "decay", "divergence"))
    decay_half_life_s: float = _knob(
        3600.0, "With eviction_policy \"decay\": a donor's hit count halves in value after "
        "this many seconds unused.", minimum=1e-3)
    divergence_threshold: float = _knob(
        0.3, "With eviction_policy \"divergence\": measured deviation (0-1; a moving average "
        "over the donor's reuses, the latest weighing half; from its 3rd reuse on) above which "
        "a donor is demoted (no longer offered); reported high again, it is evicted.",
        minimum=0.0, maximum=1.0)

    # ---- token alignment (target token -> donor token) ----------------------------------------
    align_stages: str = _knob(
        "exact,edit,sentence,lsh", "Alignment stages, in order, comma-separated: \"exact\" "
        "(token-identical runs at any offset), \"edit\" (edit-align the gaps between runs), "
        "\"sentence\" (pair reworded or moved sentences), \"lsh\" (SemShareKV's nearest "
        "token by LSH on RoPE-rotated input embeddings). \"lsh\" alone is the paper's "
        "matching.")
    align_min_run: int = _knob(
        16, "Shortest token-identical run the exact stage takes.", minimum=2)
    align_sentence_snap: int = _knob(
        4, "A run spilling at most this many tokens across a sentence boundary is cut there "
        "(0: never).", minimum=0)
    edit_min_similarity: float = _knob(
        0.3, "Edit and sentence stages: smallest normalised Levenshtein similarity of two token "
        "spans (rapidfuzz) for them to be edit-aligned; below it the pre-check skips them.",
        minimum=0.0, maximum=1.0)
    sentence_min_similarity: float = _knob(
        0.8, "Sentence stage: smallest cosine of two sentences' vectors (mean input embedding "
        "with the vocabulary's mean and top 10 principal directions removed) for them to be "
        "paired. Measured on SmolLM2 and real text: sentences with 30% of their words replaced "
        "keep a median cosine of 0.88 with their original; an unrelated sentence's best match "
        "has a median of 0.65 (95th percentile 0.77).", minimum=-1.0, maximum=1.0)
    lsh_bits: int = _knob(
        32, "LSH stage: random hyperplanes per table (lsh_bits * lsh_tables must be a multiple "
        "of 8). The paper's distance normalisation (max 30) suggests ~32-bit codes; "
        "unconfirmed.",
        minimum=1)
    lsh_tables: int = _knob(
        2, "LSH stage: independent hyperplane tables; Hamming distances add up.", minimum=1)
    lsh_max_distance: float = _knob(
        0.25, "LSH stage: largest fraction of differing code bits for a fuzzy match; farther "
        "tokens stay unaligned (computed).",
        minimum=0.0, maximum=1.0)
    lsh_rope_style: str = _knob(
        "neox", "LSH stage: RoPE pairing applied to input embeddings: \"neox\" (halves, as "
        "vLLM's Llama / Qwen / Mistral), \"gptj\" (adjacent pairs, the paper's eq. 1), "
        "\"none\".", choices=("neox", "gptj", "none"))
    lsh_rope_base: float = _knob(
        0.0, "LSH stage: RoPE base for the embeddings; 0 = the model's rope_theta.",
        minimum=0.0)
    embedding_sketch_dim: int = _knob(
        -1, "Input-embedding matrix kept by the scheduler for the sentence and LSH stages, "
        "read from the model's safetensors (only that tensor, once): -1 = whole up to 64M "
        "elements (SmolLM2: 28M), a 256-dim random projection beyond (a 7B model's 545M); "
        "0 = always whole; n = a projection to n dims.", minimum=-1)

    min_alignment_coverage: float = _knob(
        0.8, "Semantic hits: smallest share of the claimable tokens aligned to the same token "
        "of the donor for the donor's KV to be used (tokens aligned to another token carry KV "
        "no better than a random token's: they are recomputed and do not count); below it the "
        "request is computed instead (and kept as a donor). Measured with semshare-bench "
        "(2K-token doc-qa, CPU): hits whose same-token share was about 65% (threshold 0.5) or "
        "72% (threshold 0.7) recomputed about half of all token-layers and took 2.7-3.0 s "
        "against 2.9-3.2 s cold, and, served approximately, did not become donors for the "
        "prompts after them.",
        minimum=0.0, maximum=1.0)

    # ---- selective recompute ------------------------------------------------------------------
    recompute_policy: str = _knob(
        "cacheblend", "Which loaded tokens are recomputed through the model after their donor KV "
        "is written, for approximate (semantic) loads: \"cacheblend\" (every loaded token up "
        "to recompute_check_layer, then the recompute_ratio with the highest K/V deviation), "
        "\"semsharekv\" (layer 0 in full, then hot / cold tokens by attention recovery, a "
        "budget decaying with depth), \"all\" (every loaded token, exact loads included: the "
        "output equals a cold run and nothing is saved; checks the hook and runner in a "
        "deployment), \"none\". Exact-prefix loads are never repaired except under \"all\". "
        "With \"none\" there are no semantic hits (approximate KV is never used unrepaired).",
        choices=("none", "all", "cacheblend", "semsharekv"))
    recompute_ratio: float = _knob(
        0.15, "CacheBlend: share of the loaded tokens recomputed after the check layer "
        "(CacheBlend's own default).",
        minimum=0.0, maximum=1.0)
    recompute_min_tokens: int = _knob(
        0, "CacheBlend: recompute at least this many loaded tokens after the check layer, "
        "whatever recompute_ratio gives (short prompts: 15% of a few hundred tokens can leave a "
        "near-tie answer to the donor's context). On 512-token cross-instruction pairs "
        "(SmolLM2-135M, CPU, 6 pairs) a floor of 160 (29%) raised the median ROUGE-L of the "
        "hit's 32 greedy tokens against cold's from 0.56 to 0.71. 0: the ratio alone.",
        minimum=0)
    recompute_check_layer: int = _knob(
        1, "CacheBlend: the layer (0-based) up to which every loaded token is recomputed and "
        "where deviations are measured.", minimum=0)
    recompute_run_head: int = _knob(
        4, "Always recomputed: this many first tokens of every aligned run (they attended to "
        "other tokens in the donor; measured: 3x the K/V error of the rest of a run).",
        minimum=0)
    recompute_tail: int = _knob(
        8, "Always recomputed: this many last loaded tokens.", minimum=0)
    semsharekv_hot_threshold: float = _knob(
        0.55, "SemShareKV: share of the last tokens' attention that the hot tokens hold "
        "(attention recovery).", minimum=0.0, maximum=1.0)
    semsharekv_hot_ratio: float = _knob(
        0.5, "SemShareKV: share of the hot tokens recomputed (highest deviation first).",
        minimum=0.0, maximum=1.0)
    semsharekv_cold_ratio: float = _knob(
        0.1, "SemShareKV: share of the cold tokens recomputed.", minimum=0.0, maximum=1.0)
    semsharekv_layer_decay: float = _knob(
        0.9, "SemShareKV: the recompute budget is multiplied by this per layer after layer 0 "
        "(the paper's constant is unpublished).", minimum=0.0, maximum=1.0)
    semsharekv_window: int = _knob(
        32, "SemShareKV: how many last tokens' attention defines hot tokens (unpublished in "
        "the paper; an independent reimplementation uses 32).", minimum=1)

    def __post_init__(self):
        # Checks across keys (one key's range alone cannot say it).
        stages = [x.strip() for x in self.align_stages.split(",") if x.strip()]
        bad = [x for x in stages if x not in ALIGN_STAGES]
        if bad or len(set(stages)) != len(stages):
            raise SemShareConfigError(
                f"align_stages: a comma-separated subset of {', '.join(ALIGN_STAGES)} without "
                f"repeats; got {self.align_stages!r}")
        if (self.lsh_bits * self.lsh_tables) % 8:
            raise SemShareConfigError(
                f"lsh_bits * lsh_tables must be a multiple of 8; got {self.lsh_bits} * "
                f"{self.lsh_tables}")
        if self.lmcache_remote_url and "://" not in self.lmcache_remote_url:
            raise SemShareConfigError(f"lmcache_remote_url: expected a URL such as "
                                      f"redis://127.0.0.1:6379; got {self.lmcache_remote_url!r}")
        if self.shared_index_url:
            if not re.match(r"^(redis|rediss|unix)://", self.shared_index_url):
                raise SemShareConfigError(f"shared_index_url: expected a redis://, rediss:// or "
                                          f"unix:// URL; got {self.shared_index_url!r}")
            if self.kv_tier != "lmcache" or not self.lmcache_remote_url:
                raise SemShareConfigError(
                    "shared_index_url needs kv_tier \"lmcache\" and lmcache_remote_url: other "
                    "instances must be able to read the KV of the donors it announces")
            if not self.shared_index_secret:
                raise SemShareConfigError(
                    "shared_index_url needs shared_index_secret (or SEMSHARE_SHARED_INDEX_SECRET):"
                    " the key every instance signs its records with; without it any client of "
                    "the Redis server could announce donors")

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None,
                          environ: Mapping[str, str] | None = None) -> "SemShareConfig":
        """Validate ``extra`` (+ ``SEMSHARE_*`` overrides); SemShareConfigError on any fault."""
        environ = os.environ if environ is None else environ
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for key, raw in (extra or {}).items():
            if key not in fields:
                raise SemShareConfigError(
                    f"kv_connector_extra_config: unknown key {key!r}; allowed keys: "
                    f"{', '.join(sorted(fields))}")
            values[key] = _coerce(fields[key], raw, f"kv_connector_extra_config[{key!r}]",
                                  from_env=False)
        for name, f in fields.items():
            env_key = ENV_PREFIX + name.upper()
            if env_key in environ:
                values[name] = _coerce(f, environ[env_key], env_key, from_env=True)
        for env_key in environ:
            if env_key.startswith(ENV_PREFIX) and env_key[len(ENV_PREFIX):].lower() not in fields:
                if env_key in _OTHER_SEMSHARE_ENV:
                    continue
                raise SemShareConfigError(
                    f"environment: unknown variable {env_key}; allowed: "
                    f"{', '.join(ENV_PREFIX + n.upper() for n in sorted(fields))}")
        return cls(**values)

    def describe(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for f in dataclasses.fields(self):
            if f.metadata.get("secret") and out[f.name] is not None:
                out[f.name] = "***"
        return out


ALIGN_STAGES = ("exact", "edit", "sentence", "lsh")

# SEMSHARE_* variables that are not connector knobs (where derived files are cached).
_OTHER_SEMSHARE_ENV = frozenset({"SEMSHARE_CACHE_DIR"})


def cache_dir() -> Path:
    """Where derived files live (the embedder's ONNX export, the test bed's converted models):
    ``$SEMSHARE_CACHE_DIR``, else ``~/.cache/semshare-vllm``."""
    root = os.environ.get("SEMSHARE_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "semshare-vllm")
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def _coerce(f: dataclasses.Field, raw: Any, where: str, *, from_env: bool) -> Any:
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    meta = f.metadata
    if kind == "bool":
        value = _as_bool(raw, where, from_env)
    elif kind == "int":
        value = _as_size(raw, where) if meta.get("size") else _as_int(raw, where, from_env)
    elif kind == "float":
        value = _as_float(raw, where, from_env)
    elif kind == "str":
        if not isinstance(raw, str):
            raise SemShareConfigError(f"{where}: expected a string, got {raw!r}")
        value = raw
    elif kind == "str | None":
        if raw is None or (from_env and raw == ""):
            value = None
        elif isinstance(raw, str):
            value = raw
        else:
            raise SemShareConfigError(f"{where}: expected a string or null, got {raw!r}")
    else:  # pragma: no cover - a new field type must be handled here
        raise SemShareConfigError(f"{where}: unsupported field type {kind}")
    minimum, maximum, choices = meta.get("min"), meta.get("max"), meta.get("choices")
    if minimum is not None and value is not None and value < minimum:
        raise SemShareConfigError(f"{where}: must be >= {minimum}, got {raw!r}")
    if maximum is not None and value is not None and value > maximum:
        raise SemShareConfigError(f"{where}: must be <= {maximum}, got {raw!r}")
    if choices is not None and value not in choices:
        raise SemShareConfigError(f"{where}: must be one of {', '.join(choices)}; got {raw!r}")
    return value


def _as_bool(raw: Any, where: str, from_env: bool) -> bool:
    if isinstance(raw, bool):
        return raw
    if from_env and isinstance(raw, str) and raw.strip().lower() in ("1", "true", "yes", "on",
                                                                      "0", "false", "no", "off"):
        return raw.strip().lower() in ("1", "true", "yes", "on")
    raise SemShareConfigError(f"{where}: expected true or false, got {raw!r}")


def _as_int(raw: Any, where: str, from_env: bool) -> int:
    if isinstance(raw, int) and not isinstance(raw, bool):
        return raw
    if from_env and isinstance(raw, str) and re.fullmatch(r"\s*-?\d+\s*", raw):
        return int(raw)
    raise SemShareConfigError(f"{where}: expected an integer, got {raw!r}")


def _as_float(raw: Any, where: str, from_env: bool) -> float:
    if isinstance(raw, (int, float)) and not isinstance(raw, bool):
        return float(raw)
    if from_env and isinstance(raw, str):
        try:
            return float(raw)
        except ValueError:
            pass
    raise SemShareConfigError(f"{where}: expected a number, got {raw!r}")


def _as_size(raw: Any, where: str) -> int:
    if isinstance(raw, int) and not isinstance(raw, bool):
        return raw
    if isinstance(raw, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", raw)
        if m and m.group(2).upper() in _SIZE_UNITS:
            return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).upper()])
    raise SemShareConfigError(
        f"{where}: expected a byte count (integer, or a string like \"512MiB\" or \"4GiB\"), "
        f"got {raw!r}")
