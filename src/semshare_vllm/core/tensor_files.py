"""Safetensors files read into memory of our own, never as views of a memory map.

safetensors maps a file and hands out views of the map. A file rewritten in place afterwards (a
trainer saving new weights over the served checkpoint, a donor file copied over) would change
tensors already checked, or, cut short, kill the process with SIGBUS. safetensors 0.8 reads
with ``pread`` into ordinary memory (``backend="pread"``); an older one is read whole into bytes
first (twice the file's size for a moment), or, for ``open_tensors``, mapped: its callers copy
what they keep. safetensors is imported here only when a file is read.
"""

from __future__ import annotations

from pathlib import Path


def load_tensors(path: str | Path) -> dict:
    """Every tensor of the file, in memory that no file backs."""
    from safetensors.torch import load, load_file

    try:
        return load_file(str(path), backend="pread")
    except TypeError:  # safetensors < 0.8: no backend
        return load(Path(path).read_bytes())


def open_tensors(path: str | Path):
    """``safe_open`` (torch tensors) reading with ``pread`` where it can: a file cut short then
    raises, instead of a signal. Keep copies of what is read (a mapped fallback)."""
    from safetensors import safe_open

    try:
        return safe_open(str(path), framework="pt", backend="pread")
    except TypeError:  # safetensors < 0.8
        return safe_open(str(path), framework="pt")
