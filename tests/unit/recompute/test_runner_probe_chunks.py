"""``LayerRunner._probe_pass``: which chunks the narrowing layer's probe takes (its results
against one pass over every position are checked on the real model in
tests/engine/test_engine_recompute.py)."""

import contextlib
from types import SimpleNamespace

import torch

import semshare_vllm.recompute.layer_runner as lr
from semshare_vllm.recompute.layer_runner import LayerRunner


def test_the_probe_pass_goes_in_chunks_that_keep_the_last_tokens_together(monkeypatch):
    """Which chunks the probe takes: ``chunk_tokens`` at a time, a last chunk shorter than the
    attention window joined to the one before."""
    runner = LayerRunner.__new__(LayerRunner)
    taken = []

    class Part:
        def __init__(self, layer, block_ids, positions, slots, context, want, tail, **kw):
            self.layer, self.block_ids, self.positions, self.slots = (
                layer,
                block_ids,
                positions,
                slots,
            )
            self.context, self.want_deviation, self.tail = context, want, tail
            self.fault = self.attention = self.deviation_parts = None
            taken.append((int(positions[0]), int(positions[-1]) + 1, tail))

    monkeypatch.setattr(lr, "_RecomputeAttention", Part)
    monkeypatch.setattr(lr, "attention_replaced", lambda *a: contextlib.nullcontext())
    decoder = lambda *a: None  # noqa: E731
    for n, chunk, want in (
        (100, 40, [(0, 40, 0), (40, 100, 32)]),  # 20 left: fewer than 32, joined
        (120, 40, [(0, 40, 0), (40, 80, 0), (80, 120, 32)]),
        (100, None, [(0, 100, 32)]),
    ):
        runner.chunk_tokens = chunk
        whole = Part(
            SimpleNamespace(decoder=decoder), [], torch.arange(n), torch.arange(n), n, False, 32
        )
        taken.clear()
        runner._probe_pass(whole, torch.zeros(n, 4), None)
        assert taken == want, (n, chunk)
