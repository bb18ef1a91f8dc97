"""Recompute chosen positions of one request, layer by layer, over its paged (blended) KV.

After donor KV has been written into a request's blocks, some positions S hold KV that is wrong
for this prompt. ``LayerRunner.recompute`` runs S through the model's own decoder layers: each
layer's ``forward`` (norms, qkv projection, q/k norms where the model has them, RoPE at the
target positions, o_proj, residual, MLP) runs unchanged, except that its vLLM ``Attention``
module is stood in for, for the duration of the call, by ``_RecomputeAttention``, which

1. writes S's fresh K and V into the request's paged cache (overwriting the donor's), and
2. lets S's queries attend, causally by position, to the K/V of every position of the request
   read back from the paged cache (the blend: fresh where recomputed, donor elsewhere),

measuring on the way what the policy (``policy.Selection``) asked for: each position's
deviation from the donor K/V it replaces, the attention the last tokens pay. After each layer
the policy may narrow S; the hidden states of the positions it keeps flow to the next layer.
It may also find, at a later layer, that it narrowed too far (``policy.Escalate``): the runner
then goes back to the layer where it narrowed, with the hidden states every position had when
it entered that layer (kept for this), and runs the wider set from there.

Under tensor parallelism every rank runs the same recompute over its own KV heads, and the
layers' row-parallel all-reduces sum the ranks' shares of the same tokens: so what a layer
measured is summed over the ranks before the policy chooses (``vllm_compat.tensor_parallel``),
and every rank keeps the same positions. A fault inside the stand-in on one rank must not keep
that rank from the collectives the others enter: it is recorded, the layers run on (on zeros),
and the recompute raises ``RecomputeFault`` at the end, on that rank; the ranks then agree that
the load failed (``worker/loads.py``). A fault in the model's own code between its collectives
(out of memory in an MLP, say) cannot be contained this way.

vLLM's attention layer cannot be called here (it needs the step's forward-context metadata).
Where the layer's backend is CPU_ATTN, vLLM's own CPU kernels write the cache and attend over the
paged cache, each run of consecutive positions as one of the kernel's requests
(``vllm_compat.cpu_attention``); otherwise (any other backend or device, probe passes) attention
is over the K/V gathered from the paged cache (``kernels.attend_by_position``: a Triton kernel
on CUDA, torch SDPA in causal chunks elsewhere). A
layer over a prefill's positions (layer 0 takes every loaded one) runs in chunks of
``chunk_tokens`` (vLLM's ``max_num_batched_tokens``), in order, as vLLM's chunked prefill runs
it; so does the probe of the layer where the selection narrows (``_probe_pass``). Only the
model's modules are used, so any decoder with the Llama structure
works: Llama, Mistral, Qwen2, Qwen3 (q/k norms inside its own attention forward). The model's
structure is read through ``vllm_compat.decoder_layers``; anything else raises
``UnsupportedModel`` at start-up.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from semshare_vllm.kernels.position_attention import attend_by_position
from semshare_vllm.layout.paged_cache import slots_for
from semshare_vllm.layout.specs import PageSpec
from semshare_vllm.recompute.policy import Decline, Escalate, Fixed, LayerProbe, Selection
from semshare_vllm.vllm_compat import cpu_attention, tensor_parallel
from semshare_vllm.vllm_compat.decoder_layers import (
    DecoderLayer,
    UnsupportedModel,
    attention_replaced,
    decoder_stack,
)


@dataclass
class _Layer:
    decoder: DecoderLayer  # the decoder layer, as vllm_compat reads it
    cache: torch.Tensor  # this layer's paged cache
    spec: PageSpec  # ... its page layout, to read and write it by token
    cpu_isa: str | None  # CPU_ATTN layouts: vLLM's kernels serve prefill-shaped runs
    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float


class _RecomputeAttention(torch.nn.Module):
    """Stands in for one layer's vLLM Attention during a recompute (module docstring); measures
    what the selection asked for (``probe``) on the way."""

    def __init__(
        self,
        layer: _Layer,
        block_ids: list[int],
        positions: torch.Tensor,
        slots: torch.Tensor,
        context: int,
        want_deviation: bool,
        tail: int,
        probe_only: bool = False,
    ):
        super().__init__()
        self.layer, self.block_ids, self.positions = layer, block_ids, positions
        self.slots, self.context = slots, context
        self.want_deviation, self.tail = want_deviation, tail
        self.probe_only = probe_only
        # Deviation as its two sums over this rank's heads, [S] each: the ranks add them up
        # apart (LayerRunner._probe), so the ratio is the one over every head.
        self.deviation_parts: tuple[torch.Tensor, torch.Tensor] | None = None
        self.attention: torch.Tensor | None = None
        self.fault: Exception | None = None

    def forward(self, query, key, value, *args, **kwargs):
        try:
            return self._attend(query, key, value)
        except _Probed:
            raise
        except Exception as exc:
            # The layer's o_proj all-reduces next on every other rank: go on with zeros (this
            # recompute is failed at its end), and stop where the others stop.
            self.fault = exc
            if self.probe_only:
                raise _Probed from exc
            return query.new_zeros(query.shape[0], self.layer.num_heads * self.layer.head_size)

    def _attend(self, query, key, value):
        lay = self.layer
        s = query.shape[0]
        q = query.view(s, lay.num_heads, lay.head_size)
        k = key.view(s, lay.num_kv_heads, lay.head_size)
        v = value.view(s, lay.num_kv_heads, lay.head_size)
        if self.want_deviation:  # fresh vs the donor's K/V these positions held
            k_old, v_old = lay.spec.read(lay.cache, self.slots)
            k32, v32 = k.float(), v.float()
            diff = (k32 - k_old.float()).square().sum((1, 2)) + (v32 - v_old.float()).square().sum(
                (1, 2)
            )
            self.deviation_parts = (diff, k32.square().sum((1, 2)) + v32.square().sum((1, 2)))
        kernel = lay.cpu_isa is not None and not self.probe_only
        if kernel:  # vLLM's own CPU cache write and attention, on the paged cache
            out = _cpu_attention(lay, q, k, v, self.slots, self.block_ids, self.positions)
        else:
            lay.spec.write(lay.cache, self.slots, k, v)
        if self.probe_only and not self.tail:
            raise _Probed
        if self.tail or not kernel:
            k_all, v_all = lay.spec.read_range(lay.cache, self.block_ids, 0, self.context)
            if self.tail:
                self.attention = tail_attention(
                    q, k_all, self.positions, self.context - self.tail, lay.scale
                )
            if self.probe_only:
                raise _Probed
            if not kernel:
                out = attend_by_position(q, k_all, v_all, self.positions, lay.scale)
        return out.reshape(s, lay.num_heads * lay.head_size)


def _clone(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.clone()


class RecomputeFault(RuntimeError):
    """The stand-in failed in some layer on this rank; the layers ran on so that this rank kept
    up with the others' collectives, and what they computed is not to be used."""


class _Probed(Exception):
    """Ends a probe pass once its K/V are written and measured (the layer's attention output,
    o_proj and MLP are not needed for the positions the selection is about to drop)."""


def _is_tail(positions: torch.Tensor, context: int) -> bool:
    """Whether the positions are exactly the last ones of the context (a prefill's shape)."""
    n = positions.shape[0]
    return int(positions[-1]) == context - 1 and int(positions[0]) == context - n


def _cpu_attention(lay: _Layer, q, k, v, slots, block_ids, positions) -> torch.Tensor:
    """CPU_ATTN layouts: vLLM's own ops write K/V and attend over the paged cache, as a
    prefill does (faster than SDPA over gathered K/V, for a prefill's positions and for
    scattered ones: docs/benchmarks.md, "Scattered positions through vLLM's CPU kernel")."""
    cpu_attention.write_kv(lay.cache, k.contiguous(), v.contiguous(), slots, lay.cpu_isa)
    return cpu_attention.causal_attention(
        lay.cache, q, positions.cpu().numpy(), block_ids, lay.scale, lay.cpu_isa
    )


def tail_attention(
    q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, first: int, scale: float
) -> torch.Tensor:
    """Attention mass each key position receives from the queries at positions >= ``first``,
    summed over heads and those queries: ``[n]`` (SemShareKV's attention recovery input)."""
    sel = q_pos >= first
    n = k.shape[0]
    if not bool(sel.any()):
        return torch.zeros(n)
    qs = q[sel].float()
    t, num_heads, head_size = qs.shape
    num_kv, group = k.shape[1], num_heads // k.shape[1]
    # each KV head's query heads side by side, not its keys repeated (a copy of every key)
    qg = qs.view(t, num_kv, group, head_size).permute(1, 2, 0, 3).reshape(num_kv, group * t, -1)
    scores = torch.bmm(qg, k.float().permute(1, 2, 0)) * scale  # [Hkv, group * t, n]
    later = torch.arange(n, device=k.device)[None, :] > q_pos[sel][:, None]  # [t, n]
    scores.view(num_kv, group, t, n).masked_fill_(later, float("-inf"))
    return torch.softmax(scores, dim=-1).sum((0, 1))


class LayerRunner:
    """Drives one loaded vLLM model's decoder layers over a request's paged KV."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: dict[str, torch.Tensor],
        layout: PageSpec,
        chunk_tokens: int | None = None,
    ):
        """``chunk_tokens``: the most positions one layer call takes where they are the
        context's last ones (layer 0's every position), in order, as vLLM's chunked prefill
        (``max_num_batched_tokens``) runs them; None: all at once."""
        self.model = model
        self.chunk_tokens = chunk_tokens
        self.stack = decoder_stack(model)  # UnsupportedModel where it is not one we drive
        self.embed = self.stack.embed
        self.layers: list[_Layer] = []
        isa = layout.cpu_isa if layout.backend.upper() == "CPU_ATTN" else None
        for layer in self.stack.layers:
            cache = kv_caches.get(layer.layer_name)
            if cache is None:
                raise UnsupportedModel(f"no KV cache registered for {layer.layer_name}")
            layout.check(cache)
            self.layers.append(
                _Layer(
                    layer,
                    cache,
                    layout,
                    isa,
                    layer.num_heads,
                    layer.num_kv_heads,
                    layer.head_size,
                    layer.scale,
                )
            )
        self.device = self.stack.device

    @torch.inference_mode()
    def recompute(
        self,
        token_ids: list[int],
        block_ids: list[int],
        selection: Selection | np.ndarray | list[int],
        context: int | None = None,
        final_hidden: bool = False,
        donor_kv_ready: tuple[int, Callable[[], bool]] | None = None,
    ) -> RecomputeResult:
        """Recompute a request's positions chosen by ``selection`` (or a fixed list: sorted,
        distinct) layer by layer, attending to positions ``[0, context)`` (default: up to the
        last position). ``token_ids`` holds the request's tokens from position 0; its blocks are
        ``block_ids``. With ``final_hidden``, the positions still recomputed after the last layer
        come back with their final hidden state (after the model's final norm).

        ``donor_kv_ready`` ``(layer, ready)``: the donor KV is still being moved into the blocks
        (``worker/loads.py``) from ``layer`` on; ``ready()`` is called once, before that layer
        first runs, and waits for it. False stops the recompute there (``stopped``)."""
        if not isinstance(selection, Selection):
            selection = Fixed(np.asarray(selection, dtype=np.int64))
        start = selection.start()
        if len(start) == 0:
            return RecomputeResult(start, None, [], [])
        context = int(start[-1]) + 1 if context is None else context
        if int(start[-1]) >= context or int(start[0]) < 0:
            raise ValueError("positions must lie inside the context")
        bs = self.layers[0].cache.shape[2]
        if context > len(block_ids) * bs or context > len(token_ids):
            raise ValueError("the context runs past the request's blocks or tokens")
        pos_np = start
        pos = torch.as_tensor(pos_np, device=self.device)
        all_slots = slots_for(block_ids, 0, context, bs).to(self.device)
        ids = torch.as_tensor(token_ids[:context], dtype=torch.long, device=self.device)
        hidden, residual = self.embed(ids[pos]), None
        counts, fault = [0] * len(self.layers), None
        spent = [0.0] * len(self.layers)
        entered = None  # (layer, positions, hidden, residual) where the selection narrowed
        index, stopped = 0, False
        while index < len(self.layers):
            if donor_kv_ready is not None and index >= donor_kv_ready[0]:
                ready, donor_kv_ready = donor_kv_ready[1], None
                if not ready():
                    stopped = True
                    break
            began = time.perf_counter()
            lay = self.layers[index]
            want_dev, want_attn = selection.wants_probe(index)
            narrows = selection.narrows_at(index)
            if narrows:  # an escalation comes back here with more of these positions
                entered = (index, pos_np, hidden.clone(), _clone(residual))
            probe_first = narrows and (want_dev or want_attn)
            stand_in = _RecomputeAttention(
                lay,
                block_ids,
                pos,
                all_slots[pos],
                context,
                want_dev,
                selection.window if want_attn else 0,
                probe_only=probe_first,
            )
            counts[index] += len(pos_np)
            if probe_first:
                # Every position's K/V first, then the full layer for those the selection keeps.
                stand_in = self._probe_pass(stand_in, hidden, residual)
            elif self._chunks(pos, context, want_dev or want_attn):
                hidden, residual, chunk_fault = self._in_chunks(
                    lay, block_ids, pos, all_slots, hidden, residual
                )
                fault = fault or chunk_fault
            else:
                with attention_replaced(lay.decoder, stand_in):
                    hidden, residual = lay.decoder(pos, hidden, residual)
            fault = fault or stand_in.fault
            keep = selection.after_layer(self._probe(index, pos_np, stand_in, context))
            if isinstance(keep, Decline):
                spent[index] += (time.perf_counter() - began) * 1e3
                break  # (every tensor-parallel rank decides alike: no collective is left hanging)
            if isinstance(keep, Escalate):
                spent[index] += (time.perf_counter() - began) * 1e3
                if entered is None:
                    raise ValueError("a selection escalated without having narrowed")
                index, pos_np, hidden, residual = entered
                keep_t = torch.as_tensor(keep.keep, device=self.device)
                pos_np = pos_np[keep.keep]
                pos, hidden = torch.as_tensor(pos_np, device=self.device), hidden[keep_t]
                residual = None if residual is None else residual[keep_t]
                continue  # the narrowing layer again, in full for these positions
            if keep is not None and len(keep) < len(pos_np):
                pos_np = pos_np[keep]
                keep_t = torch.as_tensor(keep, device=self.device)
                pos, hidden = pos[keep_t], hidden[keep_t]
                residual = None if residual is None else residual[keep_t]
            if probe_first:
                stand_in = _RecomputeAttention(
                    lay, block_ids, pos, all_slots[pos], context, False, 0
                )
                with attention_replaced(lay.decoder, stand_in):
                    hidden, residual = lay.decoder(pos, hidden, residual)
                fault = fault or stand_in.fault
            spent[index] += (time.perf_counter() - began) * 1e3
            index += 1
        if fault is not None:
            raise RecomputeFault(f"{type(fault).__name__}: {fault}") from fault
        final = None
        if final_hidden and not selection.declined and not stopped:
            final = self.stack.final_norm(hidden, residual)
        return RecomputeResult(pos_np, final, counts, spent, stopped)

    def _probe_pass(
        self, whole: _RecomputeAttention, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> _RecomputeAttention:
        """Every position of ``whole`` (a probe-only stand-in) through the layer's norm and
        qkv: K/V written and measured, nothing attended but the last tokens' queries. The layer
        mutates its inputs in place, hence the copies. In chunks of ``chunk_tokens``, as vLLM's
        prefill and layer 0 run: over all 8K positions at once, its tensors were 2x the size of
        any that vLLM's own chunks had freed, each on fresh pages (about 20,000-30,000 page
        faults; layer 1 took 113-499 ms; docs/benchmarks.md, "Page faults in the hit path"). The
        last chunk holds the last tokens, and attends after every other chunk has written.
        ``whole`` comes back holding what the chunks measured."""
        pos, n, tail = whole.positions, len(whole.positions), whole.tail
        starts = list(range(0, n, self.chunk_tokens or n))
        if len(starts) > 1 and n - starts[-1] < tail:
            starts.pop()  # (a last chunk shorter than the window joins the one before)
        parts = []
        for lo, hi in zip(starts, starts[1:] + [n]):
            part = _RecomputeAttention(
                whole.layer,
                whole.block_ids,
                pos[lo:hi],
                whole.slots[lo:hi],
                whole.context,
                whole.want_deviation,
                tail if hi == n else 0,
                probe_only=True,
            )
            with attention_replaced(whole.layer.decoder, part), contextlib.suppress(_Probed):
                whole.layer.decoder(
                    part.positions,
                    hidden[lo:hi].clone(),
                    None if residual is None else residual[lo:hi].clone(),
                )
            whole.fault = whole.fault or part.fault
            whole.attention = part.attention
            parts.append(part.deviation_parts)
        if whole.want_deviation and all(p is not None for p in parts):
            whole.deviation_parts = tuple(torch.cat(halves) for halves in zip(*parts))
        return whole

    def _chunks(self, pos: torch.Tensor, context: int, probed: bool) -> bool:
        """Whether this layer call goes in chunks: no probe taken, more positions than a
        chunk, and they are the context's last ones (each chunk then attends to what the
        chunks before it wrote, as a chunked prefill)."""
        chunk = self.chunk_tokens
        return bool(chunk) and not probed and len(pos) > chunk and _is_tail(pos, context)

    def _in_chunks(self, lay, block_ids, pos, all_slots, hidden, residual):
        """One layer over the context's last positions, ``chunk_tokens`` at a time: a layer
        over 8K positions at once was 1.2-1.6x vLLM's own (two chunks of 4K) on a CPU core, not
        traced further than that (docs/benchmarks.md). (hidden, residual, fault)."""
        outs, res_outs, fault = [], [], None
        for lo in range(0, len(pos), self.chunk_tokens):
            hi = min(lo + self.chunk_tokens, len(pos))
            p = pos[lo:hi]
            stand_in = _RecomputeAttention(
                lay, block_ids, p, all_slots[p], int(p[-1]) + 1, False, 0
            )
            with attention_replaced(lay.decoder, stand_in):
                h, r = lay.decoder(p, hidden[lo:hi], None if residual is None else residual[lo:hi])
            fault = fault or stand_in.fault
            outs.append(h)
            res_outs.append(r)
        return torch.cat(outs), torch.cat(res_outs), fault

    @staticmethod
    def _probe(
        index: int, positions: np.ndarray, stand_in: _RecomputeAttention, context: int
    ) -> LayerProbe:
        """What the layer measured, each score summed over the tensor-parallel ranks' heads
        (one collective, where there are several ranks), so that every rank's selection ranks
        the same numbers and keeps the same positions. A rank whose stand-in failed adds zeros
        of the same shapes: the ranks' collectives must match."""
        want_deviation, tail = stand_in.want_deviation, stand_in.tail
        if not want_deviation and not tail:
            return LayerProbe(index, positions, None, None)
        s = len(positions)
        parts = []
        if want_deviation:
            parts.extend(stand_in.deviation_parts or (torch.zeros(s), torch.zeros(s)))
        if tail:
            parts.append(
                stand_in.attention if stand_in.attention is not None else torch.zeros(context)
            )
        summed = tensor_parallel.all_reduce_scores(
            torch.cat([p.detach().float().cpu().reshape(-1) for p in parts])
        )
        deviation = attention = None
        if want_deviation:
            deviation = (summed[:s] / summed[s : 2 * s].clamp_min(1e-12)).numpy()
        if tail:
            attention = summed[-context:].numpy()
        return LayerProbe(index, positions, deviation, attention)


@dataclass
class RecomputeResult:
    positions: np.ndarray  # recomputed through the last layer
    hidden: torch.Tensor | None  # their final hidden states (``final_hidden``)
    # how many positions each layer recomputed (an escalation's second pass through a layer
    # adds to it), and the time each took (ms, its probe and scoring included; host time: on
    # CUDA, launches are asynchronous and only the layers that probe wait for the device)
    per_layer: list[int]
    per_layer_ms: list[float] = field(default_factory=list)
    stopped: bool = False  # ``donor_kv_ready`` said the donor KV did not arrive

    @property
    def whole_layers_ms(self) -> float:
        """Time in the layers that ran every position the recompute started with (layer 0, a
        probe layer, every layer of a selection that never narrows)."""
        full = self.per_layer[0] if self.per_layer else 0
        return sum(ms for n, ms in zip(self.per_layer, self.per_layer_ms) if n >= full)
