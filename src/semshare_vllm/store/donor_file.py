"""On-disk format of a persisted donor: one safetensors file per (donor, tensor-parallel rank).

``<persist_dir>/<fingerprint>/<donor_id>.tp<rank>of<size>.safetensors`` holds one tensor
``pages`` of shape ``[layers, blocks, kv_heads, block_size, 2 * head_size]``: the donor's KV pages
exactly as the attention backend laid them out (so loading is a page copy), and string metadata:
namespace, token ids, how many of them were the prompt (absent in files written before it was
kept: all), layer names, the page layout's name, a blake2b checksum of the tensor bytes.
The fingerprint directory keeps donors of another model, dtype, block size or parallel layout
apart; a file of another page layout is refused when it is loaded.

Files are written to a temporary name, fsynced and renamed, so a reader sees whole files or none;
truncated or corrupted files are detected (size check from the header, checksum on load).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from semshare_vllm.core import temp_files
from semshare_vllm.core.tensor_files import load_tensors

FORMAT_VERSION = "1"
SUFFIX = ".safetensors"
_TMP_PREFIX = ".tmp-"
# A partial file of a writer that is not on this host (or unnamed) is left for this long.
STALE_PARTIAL_S = 3600.0


class CorruptDonorFile(RuntimeError):
    """A persisted donor that cannot be used: truncated, corrupted, or of another format."""


@dataclass(frozen=True)
class DonorHeader:
    path: Path
    namespace: str
    donor_id: str
    token_ids: list[int]
    layer_names: list[str]
    layout: str
    checksum: str
    num_prompt_tokens: int | None = None  # of token_ids (None: all)


def persist_root(persist_dir: str | None, geometry) -> Path | None:
    """This engine's directory under ``persist_dir``; None when donors are not persisted (unset,
    or an engine whose weights cannot be told from others: ``KVGeometry.local_only``)."""
    if not persist_dir or geometry.local_only:
        return None
    return Path(persist_dir) / geometry.fingerprint


def donor_path(root: Path, donor_id: str, tp_rank: int, tp_size: int) -> Path:
    return root / f"{donor_id}.tp{tp_rank}of{tp_size}{SUFFIX}"


def checksum(kv: torch.Tensor) -> str:
    raw = kv.contiguous().view(torch.uint8).numpy()
    return hashlib.blake2b(raw, digest_size=16).hexdigest()


def write(
    path: Path,
    namespace: str,
    donor_id: str,
    token_ids: list[int],
    layer_names: list[str],
    layout: str,
    pages: torch.Tensor,
    num_prompt_tokens: int | None = None,
) -> None:
    """Write a donor file atomically (temp file, fsync, rename)."""
    pages = pages.contiguous()
    meta = {
        "format": FORMAT_VERSION,
        "namespace": namespace,
        "donor_id": donor_id,
        "token_ids": json.dumps(token_ids),
        "layer_names": json.dumps(layer_names),
        "layout": layout,
        "checksum": checksum(pages),
    }
    if num_prompt_tokens is not None:
        meta["prompt_tokens"] = str(int(num_prompt_tokens))
    path.parent.mkdir(parents=True, exist_ok=True)
    # The writer in the name: a restart removes what a killed writer left (``stale_partials``)
    fd, tmp = temp_files.create(path.parent, _TMP_PREFIX, SUFFIX)
    os.close(fd)
    try:
        save_file({"pages": pages}, tmp, metadata=meta)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_header(path: Path) -> DonorHeader:
    """Parse and sanity-check a donor file's header without reading its tensor data."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > min(size, 64 * 2**20):
                raise CorruptDonorFile(f"{path}: header length {n} exceeds the file")
            header = json.loads(f.read(n))
        meta = header.pop("__metadata__")
        end = max(int(t["data_offsets"][1]) for t in header.values())
        if 8 + n + end != size:
            raise CorruptDonorFile(f"{path}: {size} bytes, header promises {8 + n + end}")
        if meta.get("format") != FORMAT_VERSION or set(header) != {"pages"}:
            raise CorruptDonorFile(f"{path}: not a semshare donor file of format {FORMAT_VERSION}")
        token_ids = json.loads(meta["token_ids"])
        prompt = meta.get("prompt_tokens")
        if prompt is not None:  # what ``write`` wrote: digits, at most the tokens
            if not (isinstance(prompt, str) and prompt.isdecimal()):
                raise CorruptDonorFile(f"{path}: prompt length {prompt!r}")
            prompt = int(prompt)
            if not 1 <= prompt <= len(token_ids):
                raise CorruptDonorFile(f"{path}: prompt length {prompt} of {len(token_ids)}")
        return DonorHeader(
            path=path,
            namespace=meta["namespace"],
            donor_id=meta["donor_id"],
            token_ids=token_ids,
            layer_names=json.loads(meta["layer_names"]),
            layout=meta["layout"],
            checksum=meta["checksum"],
            num_prompt_tokens=prompt,
        )
    except CorruptDonorFile:
        raise
    except (OSError, ValueError, KeyError, TypeError, OverflowError, struct.error) as exc:
        raise CorruptDonorFile(f"{path}: unreadable donor file ({exc})") from exc


def read(path: Path) -> tuple[DonorHeader, torch.Tensor]:
    """Load a donor file and verify its checksum."""
    header = read_header(path)
    try:  # not mapped: the checksum holds for exactly the pages returned
        pages = load_tensors(path)["pages"]
    except Exception as exc:  # safetensors raises its own error types
        raise CorruptDonorFile(f"{path}: {exc}") from exc
    if checksum(pages) != header.checksum:
        raise CorruptDonorFile(f"{path}: checksum mismatch")
    return header, pages


def stale_partials(root: Path) -> list[Path]:
    """Temporary files a writer left when it was killed mid-write (``core.temp_files``)."""
    return temp_files.left_behind(root, _TMP_PREFIX, SUFFIX, STALE_PARTIAL_S)
