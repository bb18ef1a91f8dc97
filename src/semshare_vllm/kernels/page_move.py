"""A semantic load's KV move on CPU: whole pages read and written token-major, rows gathered and
re-rotated in between.

``gather_rearrange`` addresses every element through an int64 offset, which a GPU runs at a
good share of its bandwidth but this CPU at 1-1.5 GB/s for a whole load (docs/benchmarks.md,
"Kernels"). Here, per layer, the donor's blocks holding the rows are read through the layout's
whole-block reshapes (``PageSpec.read_blocks``), the rows are gathered (a run: sliced) and
RoPE-corrected token-major, and the target's blocks are written back whole
(``write_blocks``). A target block that takes a row at every position is written without
being read; the others (holes, the span's edges) are read first, so positions that take no row
are written back as they were, exactly as the element scatter leaves them: the result is
bit-identical to ``gather_rearrange_reference``.
"""

from __future__ import annotations

import numpy as np
import torch

from ..layout.specs import PageSpec
from .rope import RopeTable, apply_rope_delta, rope_delta


def move_aligned_rows(
    layout: PageSpec,
    src_pages: torch.Tensor | list[torch.Tensor],
    src_blocks: list[int],
    dst_pages: torch.Tensor | list[torch.Tensor],
    dst_blocks: list[int],
    dst_start: int,
    donor_pos: np.ndarray,
    table: RopeTable | None,
) -> None:
    """For every layer pair of ``src_pages`` / ``dst_pages`` (``[blocks, H, N, C]`` each, in
    ``layout``): target position ``dst_start + j`` takes donor position ``donor_pos[j]`` (when
    >= 0), K rotated from the donor's position to its own (``table`` None: not rotated)."""
    donor_pos = np.asarray(donor_pos, dtype=np.int64)
    aligned = np.flatnonzero(donor_pos >= 0)
    if not len(aligned):
        return
    rows, targets = donor_pos[aligned], dst_start + aligned
    bs = src_pages[0].shape[2]
    # Whole blocks on both sides: partial ones by slot would cost more than the extra rows.
    src_first, src_last = int(rows.min()) // bs, int(rows.max()) // bs
    dst_first, dst_last = int(targets[0]) // bs, int(targets[-1]) // bs
    dev = dst_pages[0].device
    src_ids = torch.as_tensor(src_blocks[src_first : src_last + 1], dtype=torch.long, device=dev)
    dst_ids = torch.as_tensor(dst_blocks[dst_first : dst_last + 1], dtype=torch.long, device=dev)
    pick, place = _index(rows - src_first * bs, dev), _index(targets - dst_first * bs, dev)
    # Target blocks whose every position takes a row are written without being read first;
    # the others (holes, the span's edges) are read, so what takes no row is written back.
    covered = np.zeros((len(dst_ids), bs), dtype=bool)
    covered.flat[targets - dst_first * bs] = True
    partial = np.flatnonzero(~covered.all(axis=1))
    partial_at = torch.as_tensor(partial, device=dev)
    partial_ids = dst_ids[partial_at]
    delta = None
    if table is not None and not np.array_equal(rows, targets):
        table = table.to(dev)
        delta = rope_delta(table, torch.as_tensor(rows), torch.as_tensor(targets))
    k_dst = v_dst = None
    for src, dst in zip(src_pages, dst_pages):
        k, v = layout.read_blocks(src, src_ids)
        k, v = _take(k, pick), _take(v, pick)
        if delta is not None:  # k is this call's own copy: rotated in place
            k = apply_rope_delta(k, delta, table, k)
        if k_dst is None:  # one buffer for every layer: [blocks * N, H, D]
            shape = (len(dst_ids) * bs, *k.shape[1:])
            k_dst = torch.empty(shape, dtype=dst.dtype, device=dst.device)
            v_dst = torch.empty(shape, dtype=dst.dtype, device=dst.device)
        if len(partial):
            old_k, old_v = layout.read_blocks(dst, partial_ids)
            k_dst.view(-1, bs, *k.shape[1:]).index_copy_(
                0, partial_at, old_k.unflatten(0, (-1, bs))
            )
            v_dst.view(-1, bs, *v.shape[1:]).index_copy_(
                0, partial_at, old_v.unflatten(0, (-1, bs))
            )
        _put(k_dst, place, k)
        _put(v_dst, place, v)
        layout.write_blocks(dst, dst_ids, k_dst, v_dst)


def _index(values: np.ndarray, device) -> slice | torch.Tensor:
    """``values`` as a slice where they are consecutive (a run moved whole: no gather), else an
    index tensor on ``device``."""
    if len(values) and int(values[-1]) - int(values[0]) + 1 == len(values):
        if bool((np.diff(values) == 1).all()):
            return slice(int(values[0]), int(values[-1]) + 1)
    return torch.as_tensor(values, device=device)


def _take(x: torch.Tensor, index: slice | torch.Tensor) -> torch.Tensor:
    return x[index] if isinstance(index, slice) else x.index_select(0, index)


def _put(dst: torch.Tensor, index: slice | torch.Tensor, x: torch.Tensor) -> None:
    if isinstance(index, slice):
        dst[index] = x
    else:
        dst.index_copy_(0, index, x.to(dst.dtype))
