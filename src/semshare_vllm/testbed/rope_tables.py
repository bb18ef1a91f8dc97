"""vLLM's rotary tables, built here and carried to a machine without vLLM.

The kernel tests and the kernel benchmark take their angle tables from vLLM's own rotary modules.
A GPU machine lent for a kernel check has torch and Triton but no vLLM (and the CPU build of vLLM
does not load there), so the tables are built on this machine, saved, and loaded there:

    python -m semshare_vllm.testbed.rope_tables OUT.pt   # here, with vLLM
    SEMSHARE_TEST_ROPE_TABLES=OUT.pt pytest tests/unit/kernels/test_kernels_triton.py   # there
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from semshare_vllm.kernels.rope import RopeTable

ENV = "SEMSHARE_TEST_ROPE_TABLES"

# name -> (head_size, is_neox_style, rope_parameters, max_position)
SPECS: dict[str, tuple[int, bool, dict | None, int]] = {
    "neox": (64, True, None, 1024),
    "gptj": (64, False, None, 1024),
    "partial": (64, True, {"rope_type": "default", "partial_rotary_factor": 0.5}, 1024),
    "partial_gptj": (64, False, {"rope_type": "default", "partial_rotary_factor": 0.25}, 1024),
    "yarn": (
        64,
        True,
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
        1024,
    ),
    "neox_head80": (80, True, None, 1024),  # head size not a power of two: masked dims
    # the kernel benchmark's model shapes
    "smollm2": (64, True, {"rope_theta": 100000.0}, 8192 + 64),
    "qwen25_7b": (128, True, {"rope_theta": 1000000.0}, 32768 + 64),
}


def build(names: list[str] | None = None) -> dict[str, RopeTable]:
    """The tables from vLLM's ``get_rope`` (needs vLLM)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    out = {}
    with set_current_vllm_config(VllmConfig()):
        for name in names or list(SPECS):
            head, neox, params, max_pos = SPECS[name]
            out[name] = RopeTable.from_vllm(
                get_rope(
                    head, max_pos, is_neox_style=neox, rope_parameters=params, dtype=torch.float32
                )
            )
    return out


def save(path: str | Path, tables: dict[str, RopeTable]) -> None:
    torch.save(
        {name: (t.cos_sin, t.head_size, t.rotary_dim, t.is_neox) for name, t in tables.items()},
        path,
    )


def load(path: str | Path) -> dict[str, RopeTable]:
    return {name: RopeTable(*fields) for name, fields in torch.load(path).items()}


def tables(names: list[str] | None = None) -> dict[str, RopeTable]:
    """From the file ``$SEMSHARE_TEST_ROPE_TABLES`` names, else built with vLLM."""
    path = os.environ.get(ENV)
    if path:
        saved = load(path)
        return {name: saved[name] for name in names or list(SPECS)}
    return build(names)


def main() -> None:
    parser = argparse.ArgumentParser(description="save vLLM's rotary tables for a GPU machine")
    parser.add_argument("out")
    save(parser.parse_args().out, build())


if __name__ == "__main__":
    main()
