"""The hit path's kernels (moving KV, and the recompute's attention): each a torch reference, a
Triton kernel and a dispatcher.

Public entries:

* ``RopeTable`` (``RopeTable.from_vllm(rotary_emb)``, ``RopeTable.from_model(model)``),
  ``UnsupportedRope`` and ``correct_rope(k, src_pos, dst_pos, table, out=None)``: re-rotate
  cached keys from the donor's positions to the target's, exactly (``rope_correct_reference``
  is the torch version);
* ``gather_rearrange(src, src_rows, dst_slots, caches, offsets, table, src_pos, dst_pos)``:
  gather staged donor KV rows, RoPE-correct K, scatter into every layer's paged cache
  (``gather_rearrange_reference`` is the torch version); ``stage_rows(pages, slots, offsets)``
  reads rows out of paged KV into that staging form. ``offsets`` is the caches' ``PageOffsets``,
  from their layout's spec (``layout.specs``: ``spec.offsets(caches[0])``);
* ``move_aligned_rows(layout, src_pages, src_blocks, dst_pages, dst_blocks, dst_start,
  donor_pos, table)``: the same move on CPU, page to page through the layout's whole-block
  reads and writes (bit-identical to the reference, a few times faster there).
* ``attend_by_position(q, k, v, q_pos, scale)``: causal attention of queries at scattered
  positions over a request's keys, what the recompute attends with off vLLM's CPU backend
  (``attend_by_position_reference`` is the torch version, SDPA).

The dispatchers run Triton on CUDA tensors, torch otherwise (``impl="torch"`` / ``"triton"``
forces one; ``"triton"`` on CPU tensors needs ``TRITON_INTERPRET=1``, as in the tests). Triton is
imported only when used.
"""

from .gather_rearrange import gather_rearrange, gather_rearrange_reference, stage_rows
from .page_move import move_aligned_rows
from .position_attention import attend_by_position, attend_by_position_reference
from .rope import RopeTable, UnsupportedRope, correct_rope, rope_correct_reference

__all__ = [
    "RopeTable",
    "UnsupportedRope",
    "attend_by_position",
    "attend_by_position_reference",
    "correct_rope",
    "gather_rearrange",
    "gather_rearrange_reference",
    "move_aligned_rows",
    "rope_correct_reference",
    "stage_rows",
]
