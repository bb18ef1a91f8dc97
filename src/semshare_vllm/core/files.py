"""What a model's or an adapter's files are: each one's name, size and content digest
(``core/file_digest.py``: read once per version of the file), or the commit of a cached hub
snapshot. Equal names, sizes and mtimes say nothing of content (copies normalise timestamps), so
a file vLLM reads is never known by its mtime. Files beside it that vLLM does not read are known
by name and size (``file_sizes``: no read, and a copy made at another time is the same)."""

from __future__ import annotations

from pathlib import Path

from semshare_vllm.core.file_digest import digest


def file_contents(paths) -> list[list]:
    """``[name, size, digest]`` of each path that can be read (links followed: hub snapshots
    link to their blobs), in the order given; a path that exists but cannot be read has digest
    None (the callers treat such files as unknown)."""
    out = []
    for p in paths:
        try:
            size = Path(p).stat().st_size
        except OSError:
            continue
        out.append([Path(p).name, size, digest(Path(p))])
    return out


def file_sizes(paths) -> list[list]:
    """``[name, size]`` of each path that can be stat'ed, in the order given."""
    out = []
    for p in paths:
        try:
            out.append([Path(p).name, Path(p).stat().st_size])
        except OSError:
            continue
    return out


def hub_snapshot(
    repo: str, revision: str | None, cache_dir: str | None, filename: str = "config.json"
) -> str | None:
    """The commit of the cached snapshot of ``repo`` at ``revision`` holding ``filename``,
    offline; None if unknown (not cached, or not a repository id)."""
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(
            repo, filename, cache_dir=cache_dir, revision=revision or None
        )
    except Exception:
        return None
    if isinstance(found, str):
        return Path(found).parent.name  # .../snapshots/<commit>/<filename>
    return None
