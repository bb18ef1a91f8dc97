"""The one typed config of the connector, in sections that validate themselves.

Built from ``kv_connector_extra_config`` (the JSON given to ``--kv-transfer-config``), then
overridden by ``SEMSHARE_<KEY>`` environment variables. Anything wrong (an unknown key, a wrong
type, a value out of range) raises one ``SemShareConfigError`` naming the key and what is allowed,
at start-up: never later, in a request.

The keys are flat (``host_store_bytes``, ``lookup_deadline_ms``, ...), and so is
``SemShareConfig``: it is the union of the sections (``StoreConfig``, ``SharingConfig``,
``DiscoveryConfig``, ``AlignmentConfig``, ``RecomputeConfig``), each a frozen dataclass holding its
keys and checking the rules across them. A component that reads one section can take that
section's type (``AlignParams.from_config(config: AlignmentConfig)``); a ``SemShareConfig`` is one.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from semshare_vllm.config.alignment import ALIGN_STAGES, LSH_ROPE_STYLES, AlignmentConfig, check_lsh
from semshare_vllm.config.discovery import DiscoveryConfig
from semshare_vllm.config.knobs import ENV_PREFIX, Section, SemShareConfigError, coerce
from semshare_vllm.config.recompute import RecomputeConfig
from semshare_vllm.config.sharing import SharingConfig
from semshare_vllm.config.store import StoreConfig

__all__ = [
    "ALIGN_STAGES",
    "ENV_PREFIX",
    "LSH_ROPE_STYLES",
    "SECTIONS",
    "AlignmentConfig",
    "DiscoveryConfig",
    "RecomputeConfig",
    "Section",
    "SemShareConfig",
    "SemShareConfigError",
    "SharingConfig",
    "StoreConfig",
    "cache_dir",
    "check_lsh",
]

# The sections, in the order of their keys (and of docs/configuration.md).
SECTIONS: tuple[type[Section], ...] = (
    StoreConfig,
    SharingConfig,
    DiscoveryConfig,
    AlignmentConfig,
    RecomputeConfig,
)


# A dataclass takes its bases' fields from the last base to the first: the bases are listed in
# the reverse of SECTIONS so that the fields follow SECTIONS.
@dataclass(frozen=True)
class SemShareConfig(RecomputeConfig, AlignmentConfig, DiscoveryConfig, SharingConfig, StoreConfig):
    """Every key of the connector: the union of SECTIONS."""

    def validate(self) -> None:
        for section in SECTIONS:
            section.validate(self)
        # Rules across sections would go here; none so far.

    @classmethod
    def from_extra_config(
        cls, extra: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None
    ) -> "SemShareConfig":
        """Validate ``extra`` (+ ``SEMSHARE_*`` overrides); SemShareConfigError on any fault."""
        environ = os.environ if environ is None else environ
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for key, raw in (extra or {}).items():
            if key not in fields:
                raise SemShareConfigError(
                    f"kv_connector_extra_config: unknown key {key!r}; allowed keys: "
                    f"{', '.join(sorted(fields))}"
                )
            values[key] = coerce(
                fields[key], raw, f"kv_connector_extra_config[{key!r}]", from_env=False
            )
        for name, f in fields.items():
            env_key = ENV_PREFIX + name.upper()
            if env_key in environ:
                values[name] = coerce(f, environ[env_key], env_key, from_env=True)
        for env_key in environ:
            if env_key.startswith(ENV_PREFIX) and env_key[len(ENV_PREFIX) :].lower() not in fields:
                if env_key in _OTHER_SEMSHARE_ENV:
                    continue
                raise SemShareConfigError(
                    f"environment: unknown variable {env_key}; allowed: "
                    f"{', '.join(ENV_PREFIX + n.upper() for n in sorted(fields))}"
                )
        return cls(**values)


# SEMSHARE_* variables that are not connector knobs (where derived files are cached).
_OTHER_SEMSHARE_ENV = frozenset({"SEMSHARE_CACHE_DIR"})


def cache_dir() -> Path:
    """Where derived files live (the embedder's ONNX export, the test bed's converted models):
    ``$SEMSHARE_CACHE_DIR``, else ``~/.cache/semshare-vllm``."""
    root = os.environ.get("SEMSHARE_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "semshare-vllm"
    )
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path
