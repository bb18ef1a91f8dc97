"""What a model's or an adapter's files are, without reading them: names, sizes and mtimes of
local files, or the commit of a cached hub snapshot. Rewritten files change it; no byte of
weights is read, so it is cheap enough to ask per request."""

from __future__ import annotations

from pathlib import Path


def file_stats(paths) -> list[list]:
    """``[name, size, mtime_ns]`` of each path that can be stat'ed (links followed: hub
    snapshots link to their blobs), in the order given."""
    out = []
    for p in paths:
        try:
            st = Path(p).stat()
        except OSError:
            continue
        out.append([Path(p).name, st.st_size, st.st_mtime_ns])
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
