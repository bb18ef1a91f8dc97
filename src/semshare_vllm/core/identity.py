"""What a donor's KV belongs to: its namespace.

KV depends on more than a prompt's token ids. vLLM's own prefix cache keys a block on the
tenant's ``cache_salt``, the LoRA adapter, the multimodal inputs placed in it and the prompt
embeddings (``vllm/v1/core/kv_cache_utils.py``); a donor's namespace carries the same identity, so
donors are matched, found, captured and shared only within one identity:

* ``cache_salt`` (the tenant): a request without extras has its salt as namespace ("" when none);
* the LoRA adapter (name and path, as vLLM keys it);
* multimodal inputs: each one's hash and where its placeholder sits. Such requests reuse exact
  prefixes only (their positions are not plain RoPE positions for every model);
* prompt embeddings: their token ids are placeholders, so these requests are never keyed at all
  (neither served nor captured).

The encoding is one-to-one: a namespace with extras (or a salt that could be mistaken for one) is
a marker plus canonical JSON, never a plain salt.
"""

from __future__ import annotations

import json

_MARK = "\x00semshare:"


def namespace_of(request) -> str:
    salt = getattr(request, "cache_salt", None) or ""
    extras: dict[str, object] = {}
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        extras["lora"] = [str(lora.lora_name), str(getattr(lora, "lora_path", "") or "")]
    features = getattr(request, "mm_features", None)
    if features:
        extras["mm"] = [
            [str(f.identifier), int(f.mm_position.offset), int(f.mm_position.length)]
            for f in features
        ]
    if not extras and not salt.startswith(_MARK):
        return salt
    return _MARK + json.dumps([salt, extras], sort_keys=True, separators=(",", ":"))


def keyable(request) -> bool:
    """False for prompt-embedding requests: their token ids do not say what their KV is."""
    return getattr(request, "prompt_embeds", None) is None


def semantic_allowed(request) -> bool:
    """Approximate (moved, RoPE-corrected, repaired) KV only for plain text requests:
    multimodal placeholders get other positions (M-RoPE) in some models, and the repair runs
    the model's layers outside vLLM's batch (LoRA layers would apply the batch's adapters), so
    multimodal and LoRA requests reuse exact prefixes only."""
    return (
        not getattr(request, "mm_features", None) and getattr(request, "lora_request", None) is None
    )


def tenant_of(namespace: str) -> str:
    """The ``cache_salt`` part of a namespace (for logs: never a whole identity)."""
    if not namespace.startswith(_MARK):
        return namespace
    return json.loads(namespace[len(_MARK) :])[0]
