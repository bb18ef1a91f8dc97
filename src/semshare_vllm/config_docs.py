"""docs/configuration.md, generated from ``SemShareConfig``: a heading per config section (its
``TITLE`` and doc string), and every key's default, allowed values and doc text from its field in
``config/`` (the one place they are written).

``python -m semshare_vllm.config_docs`` rewrites the page;
``tests/unit/config/test_config_docs.py`` fails when the committed page and ``render()`` differ.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from pathlib import Path
from typing import Any

from semshare_vllm import config
from semshare_vllm.config import ALIGN_STAGES, ENV_PREFIX, SemShareConfig

# (title, section class), in the order of SemShareConfig's fields.
SECTIONS: tuple[tuple[str, type[config.Section]], ...] = tuple(
    (section.TITLE, section) for section in config.SECTIONS
)

_CHECKOUT = Path(__file__).resolve().parents[2]  # src/semshare_vllm/ -> the repository root
# The page in this checkout; from an installed package, docs/ under the current directory.
DOCS_PATH = (
    (_CHECKOUT if (_CHECKOUT / "pyproject.toml").is_file() else Path.cwd())
    / "docs"
    / "configuration.md"
)

_INTRO = f"""\
# Configuration reference

Every key of the connector, generated from `semshare_vllm.config.SemShareConfig` (the fields'
doc strings in `src/semshare_vllm/config/`, a module per section); do not edit this page by hand,
run `python -m semshare_vllm.config_docs` to regenerate it.

## How keys are given

Keys go in `kv_connector_extra_config`, the JSON object inside vLLM's `--kv-transfer-config`:

```
vllm serve MODEL --kv-transfer-config '{{"kv_connector":"SemShareConnector",
  "kv_connector_module_path":"semshare_vllm.connector","kv_role":"kv_both",
  "kv_connector_extra_config":{{"host_store_bytes":"16GiB","persist_dir":"/data/donors"}}}}'
```

- An environment variable `{ENV_PREFIX}<KEY>` (the key in upper case, e.g.
  `{ENV_PREFIX}HOST_STORE_BYTES=8GiB`) overrides the JSON value. From the environment, booleans
  are `1` / `true` / `yes` / `on` or `0` / `false` / `no` / `off`, and an empty value unsets an
  optional key; in the JSON, values have their JSON type (`true`, `32`, `0.7`, `"lru"`, `null`).
- Sizes are integer bytes or a string with a unit: `"512MiB"`, `"4GiB"`, `"1.5GB"` (B, KB, MB,
  GB, TB in powers of 1000; KiB, MiB, GiB, TiB in powers of 1024; case-insensitive).
- An unknown key (in the JSON or as a `{ENV_PREFIX}*` variable), a wrong type, a value out of
  range or keys that contradict each other stop start-up with one `SemShareConfigError` naming
  the key and what is allowed: never later, in a request.
- Secret keys (`shared_index_secret`) are never shown: not in logs, not in the connector's
  description of its configuration. Give them through the environment (vLLM logs its arguments).
- Also honoured: `SEMSHARE_CACHE_DIR` (where derived files are cached: the weight and adapter
  files' content digests, the embedder's ONNX export, the test bed's converted models; default
  `~/.cache/semshare-vllm`).
- The connector sets vLLM's `kv_load_failure_policy` to `"recompute"`: a donor that cannot be
  loaded costs a recompute of its tokens, never the request.
"""


def sections() -> list[tuple[str, list[dataclasses.Field]]]:
    """The fields of SemShareConfig grouped by section, in the dataclass's order."""
    fields = dataclasses.fields(SemShareConfig)
    grouped = [
        (title, [f for f in fields if f.name in _names(section)]) for title, section in SECTIONS
    ]
    if [f.name for _, group in grouped for f in group] != [f.name for f in fields]:
        raise ValueError("SemShareConfig's fields must be those of SECTIONS, in their order")
    return grouped


def _names(section: type) -> set[str]:
    return {f.name for f in dataclasses.fields(section)}


def summary(section: type) -> str:
    """What a section covers: its doc string, on one line."""
    return " ".join(inspect.cleandoc(section.__doc__ or "").split())


def _type_name(f: dataclasses.Field) -> str:
    return f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))


def _size(n: int) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def _number(x: Any) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def format_default(f: dataclasses.Field) -> str:
    value = f.default
    if f.metadata.get("secret") or value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str):
        return f'`"{value}"`'
    if f.metadata.get("size"):
        return f"`{_size(value)}`"
    return f"`{_number(value)}`"


def format_allowed(f: dataclasses.Field) -> str:
    meta, kind = f.metadata, _type_name(f)
    if meta.get("choices"):
        return ", ".join(f'`"{c}"`' for c in meta["choices"])
    if kind == "bool":
        return "`true`, `false`"
    if f.name == "align_stages":  # checked across the list in AlignmentConfig.validate
        return "comma-separated, no repeats: " + ", ".join(f"`{s}`" for s in ALIGN_STAGES)
    if kind == "str | None":
        return "a string (secret: never shown)" if meta.get("secret") else "a string, or unset"
    if kind == "str":
        return "a string"
    lo, hi = meta.get("min"), meta.get("max")
    what = (
        "bytes (integer or size string)"
        if meta.get("size")
        else "integer"
        if kind == "int"
        else "number"
    )
    if lo is not None and hi is not None:
        return f"{what}, {_number(lo)} to {_number(hi)}"
    if lo is not None:
        return f"{what} ≥ {_number(lo)}"
    if hi is not None:
        return f"{what} ≤ {_number(hi)}"
    return what


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def render() -> str:
    out = [_INTRO.rstrip("\n")]
    for (title, section), (_, fields) in zip(SECTIONS, sections()):
        out += [
            "",
            f"## {title}",
            "",
            f"`{section.__name__}`: {summary(section)}",
            "",
            "| key | default | allowed values | description |",
            "|---|---|---|---|",
        ]
        for f in fields:
            out.append(
                f"| `{f.name}` | {format_default(f)} | {format_allowed(f)} | "
                f"{_cell(f.metadata['doc'])} |"
            )
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    path = Path(argv[0]) if argv else DOCS_PATH
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(), encoding="utf-8")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
