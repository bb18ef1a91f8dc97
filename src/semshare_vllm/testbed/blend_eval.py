"""Blend a donor's KV into a target prompt and measure, per recompute policy, how far the result
is from the target's cold computation. Used by tests and ``benchmarks/recompute_quality.py``.

Everything runs on the engine's own loaded model through ``LayerRunner``, on private paged
caches of the engine's layout (never the engine's cache):

1. the donor's KV: the runner over every donor position (the same KV vLLM computes; tested);
2. the target's cold reference: the runner over every target position, final hidden state and
   next-token logits of the last position;
3. the blend: ``alignment.align`` maps target positions to donor positions; the aligned donor
   rows are moved into the target's blocks with ``kernels.gather_rearrange`` (K RoPE-corrected
   from the donor's positions to the target's); unaligned positions hold zeros;
4. per policy: a copy of the blend, repaired by the runner under that policy; the last position
   is always recomputed (vLLM computes the last prompt token itself), and its final hidden state
   and logits are compared with the cold ones.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import numpy as np
import torch

from semshare_vllm.alignment import Alignment, AlignParams, MatchKind, align, with_echoes
from semshare_vllm.config.recompute import RecomputeConfig
from semshare_vllm.kernels import RopeTable, gather_rearrange
from semshare_vllm.layout.paged_cache import slots_for
from semshare_vllm.layout.specs import PageSpec
from semshare_vllm.recompute.layer_runner import LayerRunner
from semshare_vllm.recompute.policy import Selection
from semshare_vllm.scheduler.planner import plan_claim


@dataclass
class Outcome:
    name: str
    recomputed: float  # mean share of the loaded positions recomputed per layer
    hidden_error: float  # |h - h_cold| / |h_cold| of the last position's final hidden state
    logit_error: float  # max |logit - logit_cold|
    same_top1: bool
    runner_seconds: float  # the repair alone (not the blend copy, not the logits)


class BlendBench:
    def __init__(
        self,
        model: torch.nn.Module,
        layout: PageSpec,
        like: torch.Tensor,
        layer_names: list[str],
        donor: list[int],
        target: list[int],
        params: AlignParams = AlignParams(stages=("exact", "edit")),
        prompt_len: int | None = None,
    ):
        """``prompt_len``: the target's prompt ends there and the rest is a continuation (a
        reference the bench scores): only the prompt is aligned, as the connector aligns a
        served request."""
        self.model, self.layout, self.names = model, layout, layer_names
        self.donor, self.target = list(donor), list(target)
        bs = like.shape[2]
        nd, nt = -(-len(donor) // bs), -(-len(target) // bs)
        self.caches = {
            n: torch.zeros((nd + 2 * nt, *like.shape[1:]), dtype=like.dtype) for n in layer_names
        }
        self.donor_blocks = list(range(nd))
        self.cold_blocks = list(range(nd, nd + nt))
        self.blend_blocks = list(range(nd + nt, nd + 2 * nt))
        self.runner = LayerRunner(model, self.caches, layout)
        self.rope = RopeTable.from_model(model)
        n = len(target)
        head = target[:prompt_len]
        self.alignment = _padded(with_echoes(align(head, donor, params), head, donor), n)
        self.runner.recompute(self.donor, self.donor_blocks, np.arange(len(donor)))
        cold = self.runner.recompute(self.target, self.cold_blocks, np.arange(n), final_hidden=True)
        self.cold_hidden = cold.hidden[-1].float()
        self.cold_logits = self._logits(cold.hidden[-1:])
        self.blended = self._blend()

    @classmethod
    def on_engine(cls, worker, donor: list[int], target: list[int], **kwargs) -> "BlendBench":
        """On an in-process engine's loaded model and KV layout (``worker``: the worker half of
        its SemShare connector, ``testbed.offline.connector_halves``)."""
        return cls(
            worker.kv.repairer.runner.model,
            worker.kv.layout,
            worker.kv.caches[0],
            list(worker.geometry.layer_names),
            donor,
            target,
            **kwargs,
        )

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)[0].float()

    def _blend(self) -> dict[str, torch.Tensor]:
        """Snapshot of the caches with the donor's KV moved into the target's blocks."""
        al = self.alignment
        t = np.flatnonzero(al.donor_pos >= 0)
        staged = torch.stack(
            [
                torch.cat(
                    self.layout.read_range(
                        self.caches[name], self.donor_blocks, 0, len(self.donor)
                    ),
                    dim=-1,
                )
                for name in self.names
            ]
        )
        bs = self.caches[self.names[0]].shape[2]
        dst = slots_for(self.blend_blocks, 0, len(self.target), bs)[t]
        caches = [self.caches[name] for name in self.names]
        gather_rearrange(
            staged,
            torch.as_tensor(al.donor_pos[t]),
            dst,
            caches,
            self.layout.offsets(caches[0]),
            self.rope,
            torch.as_tensor(al.donor_pos[t]),
            torch.as_tensor(t),
        )
        return {name: c.clone() for name, c in self.caches.items()}

    def always(
        self,
        run_head: int = 4,
        tail: int = 8,
        echo_span: int = RecomputeConfig.recompute_echo_span,
        echo_max_share: float = RecomputeConfig.recompute_echo_max_share,
    ) -> np.ndarray:
        """What the connector would always recompute when claiming all but the last token."""
        end = len(self.target) - 1
        plan = plan_claim(None, self.alignment, 0, end, run_head, tail, echo_span, echo_max_share)
        return np.asarray(plan.always, dtype=np.int64)

    def continuation_nll(self, selection: Selection | None, prompt_len: int) -> float:
        """Mean negative log-likelihood (nats per token) of ``target[prompt_len:]`` after the
        prompt, as the bench scores a reference: cold (``selection`` None), or with the blend's
        first ``prompt_len - 1`` positions loaded and repaired under ``selection`` over them,
        and the rest (the prompt's last token, the continuation) computed after it, as vLLM
        does after a hit."""
        n, loaded = len(self.target), prompt_len - 1
        if not 0 < loaded < n - 1:
            raise ValueError("the prompt must leave a continuation and load a position")
        if selection is None:
            blocks = self.cold_blocks
            out = self.runner.recompute(self.target, blocks, np.arange(n), final_hidden=True)
            hidden = out.hidden[loaded:]
        else:
            blocks = self.blend_blocks
            for key, c in self.caches.items():
                c.copy_(self.blended[key])
            self.runner.recompute(self.target, blocks, selection, context=loaded)
            rest = np.arange(loaded, n)
            hidden = self.runner.recompute(self.target, blocks, rest, final_hidden=True).hidden
        logprobs = torch.log_softmax(self.model.compute_logits(hidden[:-1]).float(), dim=-1)
        nxt = torch.as_tensor(self.target[prompt_len:])
        return float(-logprobs[torch.arange(len(nxt)), nxt].mean())

    def evaluate(self, name: str, selection: Selection) -> Outcome:
        """Repair a fresh copy of the blend under ``selection`` (whose candidates should include
        the last position); compare the last position with cold."""
        for key, c in self.caches.items():
            c.copy_(self.blended[key])
        n = len(self.target)
        t0 = time.perf_counter()
        res = self.runner.recompute(
            self.target, self.blend_blocks, selection, context=n, final_hidden=True
        )
        seconds = time.perf_counter() - t0
        if len(res.positions) == 0 or res.positions[-1] != n - 1:
            raise ValueError("the selection dropped the last position")
        hidden = res.hidden[-1].float()
        logits = self._logits(res.hidden[-1:])
        loaded = n - 1
        share = float(np.mean([min(c, loaded) for c in res.per_layer])) / loaded
        return Outcome(
            name,
            share,
            float((hidden - self.cold_hidden).norm() / self.cold_hidden.norm()),
            float((logits - self.cold_logits).abs().max()),
            bool(logits.argmax() == self.cold_logits.argmax()),
            seconds,
        )


def _padded(al: Alignment, n: int) -> Alignment:
    """``al`` over ``n`` target positions, those past it unaligned."""
    extra = n - len(al.donor_pos)
    if extra <= 0:
        return al
    return replace(
        al,
        donor_pos=np.concatenate([al.donor_pos, np.full(extra, -1, dtype=np.int64)]),
        kind=np.concatenate([al.kind, np.full(extra, MatchKind.NONE, dtype=al.kind.dtype)]),
    )
