"""What a donor's KV belongs to: its namespace.

KV depends on more than a prompt's token ids. vLLM's own prefix cache keys a block on the
tenant's ``cache_salt``, the LoRA adapter, the multimodal inputs placed in it and the prompt
embeddings (``vllm/v1/core/kv_cache_utils.py``); a donor's namespace carries the same identity, so
donors are matched, found, captured and shared only within one identity:

* ``cache_salt`` (the tenant): a request without extras has its salt as namespace ("" when none);
* the LoRA adapter: name and path, as vLLM keys it, and what its files are while they stay as
  this process first saw them (``adapter_files``). vLLM's prefix cache lives and dies with its
  process; donors outlive it (``persist_dir``, the shared index), so an adapter retrained at the
  same path must not find its old donors;
* multimodal inputs: each one's hash and where its placeholder sits. Such requests reuse exact
  prefixes only (their positions are not plain RoPE positions for every model);
* prompt embeddings: their token ids are placeholders, so these requests are never keyed at all
  (neither served nor captured).

The encoding is one-to-one: a namespace with extras (or a salt that could be mistaken for one) is
a marker plus canonical JSON, never a plain salt.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

from semshare_vllm.core.file_digest import recently_changed
from semshare_vllm.core.files import file_contents, file_sizes, hub_snapshot

_MARK = "\x00semshare:"
# An adapter directory's files vLLM reads (``lora/peft_helper.py``, ``lora/lora_model.py``).
_READ_BY_VLLM = ("adapter_", "new_embeddings")
# Stands for an adapter whose files cannot be read from here: its donors serve this process only.
_THIS_PROCESS = uuid.uuid4().hex
# (lora_int_id, name, path) -> what its files were when this process first saw it; as many
# entries as adapters the engine was asked for (vLLM keeps its own table of them too).
_ADAPTERS: dict[tuple, object] = {}


def namespace_of(request) -> str:
    salt = getattr(request, "cache_salt", None) or ""
    extras: dict[str, object] = {}
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        path = str(getattr(lora, "lora_path", "") or "")
        extras["lora"] = [str(lora.lora_name), path, adapter_files(lora, path)]
    features = getattr(request, "mm_features", None)
    if features:
        extras["mm"] = [
            [str(f.identifier), int(f.mm_position.offset), int(f.mm_position.length)]
            for f in features
        ]
    if not extras and not salt.startswith(_MARK):
        return salt
    return _MARK + json.dumps([salt, extras], sort_keys=True, separators=(",", ":"))


def adapter_files(lora, path: str) -> object:
    """What the adapter vLLM runs for ``lora`` is: its files as this process first saw them for
    that id, while they stay so. vLLM reads an adapter's files again when it loads it anew (a
    new id, an id back after its LRU cache dropped it, ``load_inplace``), so once they changed
    nobody here knows which version computed a request's KV: this process only (as vLLM's own
    prefix cache, keyed on name and path), never a restart nor another instance."""
    if getattr(lora, "load_inplace", False):
        return {"process": _THIS_PROCESS}
    key = (getattr(lora, "lora_int_id", None), str(lora.lora_name), path)
    now = _files_now(path)
    first = _ADAPTERS.setdefault(key, now)  # (atomic: two threads keep the same first)
    return first if now == first else {"process": _THIS_PROCESS}


def _files_now(path: str) -> object:
    """A local adapter directory's files (PEFT writes them flat): the names, sizes and content
    digests of those vLLM reads (``adapter_config.json``, ``adapter_model.*``; each read once per
    version of it), the names and sizes of the others (a trainer's ``optimizer.pt`` beside them
    is not read); a cached hub snapshot's commit; or, where neither can be read (a resolver's
    URL), this process: its donors are then never restored by another process nor shared with
    another instance."""
    local = Path(path) if path else None
    try:
        read, others = None, []
        if local is not None and local.is_dir():
            names = sorted(p for p in local.iterdir() if p.is_file())
            read = [p for p in names if p.name.startswith(_READ_BY_VLLM)]
            others = [p for p in names if p not in read]
        elif local is not None and local.is_file():
            read = [local]
        if read is not None and any(recently_changed(p) for p in read):
            # (just written, or by another clock: its digest would be read again at every
            # call, and the next write within the clock's tick would keep its version)
            return {"process": _THIS_PROCESS}
        files = None if read is None else {"files": file_contents(read)}
        if others:
            files["others"] = file_sizes(others)
    except OSError:  # unreadable here (permissions): vLLM's worker may still load it
        return {"process": _THIS_PROCESS}
    if files is not None:
        if any(content is None for _, _, content in files["files"]):
            return {"process": _THIS_PROCESS}
        return files
    commit = hub_snapshot(path, None, None, "adapter_config.json") if path else None
    return {"hub": commit} if commit else {"process": _THIS_PROCESS}


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
