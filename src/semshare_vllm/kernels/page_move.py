"""A semantic load's KV move on CPU: whole pages read and written token-major, rows gathered and
re-rotated in between.

``gather_rearrange`` addresses every element through an int64 offset, which a GPU runs at a
good share of its bandwidth but this CPU at 2-4 GB/s (docs/benchmarks.md, "Kernels"). Here the
donor's span is read once per layer through the layout's whole-block reshapes
(``PageSpec.read_range``), rows are gathered and RoPE-corrected token-major, and the target's
span is written back the same way (``write_range``): a few bulk copies per layer. Target
positions without a donor row keep what their pages hold (their span is read first), exactly as
the element scatter leaves them; the result is bit-identical to ``gather_rearrange_reference``.
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
    src_ids = torch.as_tensor(src_blocks[src_first : src_last + 1], dtype=torch.long)
    dst_ids = torch.as_tensor(dst_blocks[dst_first : dst_last + 1], dtype=torch.long)
    pick = torch.as_tensor(rows - src_first * bs)
    place = torch.as_tensor(targets - dst_first * bs)
    delta = None
    if table is not None and not np.array_equal(rows, targets):
        delta = rope_delta(table, torch.as_tensor(rows), torch.as_tensor(targets))
        table = table.to(delta.cos.device)
    for src, dst in zip(src_pages, dst_pages):
        k, v = layout.read_blocks(src, src_ids)
        k, v = k.index_select(0, pick), v.index_select(0, pick)
        if delta is not None:  # k is a fresh copy: rotated in place
            k = apply_rope_delta(k, delta, table, k)
        # The target's blocks are rewritten whole: every position that takes no row (holes,
        # the blocks' other tokens) is written back as it was read.
        k_dst, v_dst = layout.read_blocks(dst, dst_ids)
        k_dst.index_copy_(0, place, k.to(k_dst.dtype))
        v_dst.index_copy_(0, place, v.to(v_dst.dtype))
        layout.write_blocks(dst, dst_ids, k_dst, v_dst)
