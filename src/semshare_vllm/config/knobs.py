"""What every config section is made of: ``knob`` fields (a default, the doc text the reference
page is generated from, the allowed range or choices), their parsing from JSON or environment
values (``coerce``), and ``Section``, the base of the sections, which validates on construction.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

ENV_PREFIX = "SEMSHARE_"

_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


class SemShareConfigError(ValueError):
    """A bad configuration value; the message names the key."""


def knob(
    default: Any,
    doc: str,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    size: bool = False,
    choices: tuple[str, ...] | None = None,
    secret: bool = False,
):
    # secret: never shown (repr, describe(), which the connector logs)
    return field(
        default=default,
        repr=not secret,
        metadata={
            "doc": doc,
            "min": minimum,
            "max": maximum,
            "size": size,
            "choices": choices,
            "secret": secret,
        },
    )


@dataclass(frozen=True)
class Section:
    """A group of keys. A section's ``validate`` checks the rules across its own keys (one key's
    range alone is checked by ``coerce``); it runs when the section is built, and
    ``SemShareConfig`` runs every section's. ``TITLE`` and the class's doc string head the
    section on docs/configuration.md."""

    TITLE = ""

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Raise SemShareConfigError naming the key when this section's keys contradict."""

    def describe(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for f in dataclasses.fields(self):
            if f.metadata.get("secret") and out[f.name] is not None:
                out[f.name] = "***"
        return out


def coerce(f: dataclasses.Field, raw: Any, where: str, *, from_env: bool) -> Any:
    """``raw`` (a JSON value, or an environment string when ``from_env``) as ``f``'s type, within
    its range and choices; SemShareConfigError naming ``where`` otherwise."""
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
    if (
        from_env
        and isinstance(raw, str)
        and raw.strip().lower() in ("1", "true", "yes", "on", "0", "false", "no", "off")
    ):
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
        f'{where}: expected a byte count (integer, or a string like "512MiB" or "4GiB"), '
        f"got {raw!r}"
    )
