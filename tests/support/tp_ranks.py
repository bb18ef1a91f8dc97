"""What each rank of a two-process tensor-parallel group runs (``tp_pair.TPPair`` spawns them):
vLLM's own parallel state on gloo (CPU), and a worker half whose selective recompute drives a
stand-in model with the row-parallel shape that makes disagreement visible.

The stand-in is a two-layer Llama-structure decoder (vLLM ``Attention`` modules, as
``decoder_layers`` reads them) split the way vLLM splits attention under tensor parallelism:
each rank projects its own KV heads (its own weights and its own donor KV, so each rank's
scores differ), and ``o_proj`` is row-parallel, summing the ranks' partial outputs with vLLM's
``tensor_model_parallel_all_reduce``. Ranks that recompute different positions sum different
tokens; different counts leave one rank waiting in that all-reduce.

Apart from ``collectives``, the scenarios drive the worker through vLLM's callbacks only
(``start_load_kv``, ``get_block_ids_with_load_errors``): they show what code without the
agreement does too (different positions, different blocks reported, a hang).
"""

from __future__ import annotations

import contextlib
import os
import time
from types import SimpleNamespace

import torch

from semshare_vllm.testbed import worker_rpc
from support.worker import BS, LAYERS, D, H, caches, fake_layer, geometry

HEADS = 4  # query heads per rank (GQA 2:1 over the H KV heads)
HIDDEN = 64
VOCAB = 128
TOKENS = 3 * BS  # the donor, and the load: three blocks
DONOR_BLOCKS, TARGET_BLOCKS = [1, 2, 3], [4, 5, 6]


# ---- the rank's process ------------------------------------------------------------------------
def serve(rank: int, port: int, commands, results) -> None:
    """Join the group, then run the scenarios named on ``commands`` until None."""
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state

    with set_current_vllm_config(VllmConfig()):
        parallel_state.init_distributed_environment(
            world_size=2,
            rank=rank,
            distributed_init_method=f"tcp://127.0.0.1:{port}",
            local_rank=rank,
            backend="gloo",
        )
        parallel_state.initialize_model_parallel(2, backend="gloo")
    worker_rpc.record_recomputes(None)
    results.put((rank, "ready"))
    while (name := commands.get()) is not None:
        try:
            out = SCENARIOS[name](rank)
        except BaseException as exc:  # reported to the test, which fails on it
            out = {"error": f"{type(exc).__name__}: {exc}"}
        results.put((rank, out))


# ---- the stand-in model ------------------------------------------------------------------------
def _attention(i: int):
    """vLLM's ``Attention`` with what its constructor sets (that needs a whole engine config)."""
    from vllm.model_executor.layers.attention.attention import Attention

    attn = Attention.__new__(Attention)
    torch.nn.Module.__init__(attn)
    attn.layer_name = LAYERS[i]
    attn.num_heads, attn.num_kv_heads, attn.head_size = HEADS, H, D
    attn.sliding_window, attn.has_sink = None, False
    attn.impl = SimpleNamespace(scale=D**-0.5, logits_soft_cap=None)
    return attn


class _SelfAttn(torch.nn.Module):
    def __init__(self, attn, gen: torch.Generator):
        super().__init__()
        self.attn = attn
        self.qkv = torch.nn.Linear(HIDDEN, (HEADS + 2 * H) * D, bias=False)
        self.o_proj = torch.nn.Linear(HEADS * D, HIDDEN, bias=False)  # this rank's rows
        with torch.no_grad():
            for p in (self.qkv.weight, self.o_proj.weight):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)

    def forward(self, positions, hidden):
        from vllm.distributed import tensor_model_parallel_all_reduce

        q, k, v = self.qkv(hidden).split([HEADS * D, H * D, H * D], dim=-1)
        return tensor_model_parallel_all_reduce(self.o_proj(self.attn(q, k, v)))


class _Layer(torch.nn.Module):
    def __init__(self, attn, gen):
        super().__init__()
        self.self_attn = _SelfAttn(attn, gen)

    def forward(self, positions, hidden, residual):
        residual = hidden if residual is None else hidden + residual
        return self.self_attn(positions, hidden), residual


class _Norm(torch.nn.Module):
    def forward(self, hidden, residual):
        return hidden + residual, hidden + residual


class _Inner(torch.nn.Module):
    def __init__(self, rank: int):
        super().__init__()
        gen = torch.Generator().manual_seed(100 + rank)  # each rank's own heads
        self.layers = torch.nn.ModuleList(_Layer(_attention(i), gen) for i in range(len(LAYERS)))
        self.embedding = torch.nn.Embedding(VOCAB, HIDDEN)
        with torch.no_grad():  # (vocab-parallel in vLLM: the same rows on every rank)
            self.embedding.weight.copy_(
                torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(7))
            )
        self.norm = _Norm()

    def embed_input_ids(self, ids):
        return self.embedding(ids)


def stand_in_model(rank: int) -> torch.nn.Module:
    model = type("LlamaForCausalLM", (torch.nn.Module,), {})()
    model.model = _Inner(rank)
    return model


# ---- a worker half over it ---------------------------------------------------------------------
def worker(rank: int, **config):
    """A registered worker half (rank's own donor KV in its caches) whose repairer drives the
    stand-in model over its paged caches."""
    from semshare_vllm.config import SemShareConfig
    from semshare_vllm.recompute.layer_runner import LayerRunner
    from semshare_vllm.worker import SemShareWorker, setup
    from semshare_vllm.worker.repair import Repairer

    def make_repairer(config, geometry, vllm_config, kv_caches, layout, cache, *rest):
        runner = LayerRunner(stand_in_model(rank), kv_caches, layout)
        return Repairer(runner, None, layout.offsets(cache))

    setup.make_repairer = make_repairer  # (this process's own module: nothing to restore)
    views = {name: v[0] for name, v in caches().items()}
    ctx = {name: fake_layer(views[name]) for name in LAYERS}
    vllm_config = SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context=ctx))
    cfg = dict(host_store_bytes=1 << 22, recompute_check_layer=0, recompute_ratio=0.25)
    cfg.update(config)
    w = SemShareWorker(SemShareConfig(**cfg), geometry(tp_size=2), vllm_config)
    w.register_kv_caches(views)
    assert w.disabled is None and w.kv.repairer is not None, w.disabled
    gen = torch.Generator().manual_seed(rank)
    for cache in w.kv.caches:
        cache.copy_(torch.randn(cache.shape, generator=gen))
    return w


def _load_once(rank: int, policy: str, before_load=None, donor_pos=None, **config) -> dict:
    """Capture a donor, then load it into other blocks under ``policy`` (a semantic load where
    ``donor_pos`` is given): what this rank recomputed and reports."""
    from semshare_vllm.core.keys import DonorKey
    from semshare_vllm.metadata import CaptureSpec, LoadSpec, SemShareConnectorMetadata

    w = worker(rank, **config)
    key = DonorKey("", "donor")
    ids = [(7 * i) % VOCAB for i in range(TOKENS)]
    w.start_load_kv(SemShareConnectorMetadata(captures=[CaptureSpec("a", key, ids, DONOR_BLOCKS)]))
    w.start_captures()
    w.flush_captures()
    w.get_finished({"a"})
    if before_load is not None:
        before_load(w)
    worker_rpc.take_recomputes(None)
    spec = LoadSpec(
        "b", key, 0, 0, TOKENS, TARGET_BLOCKS, policy=policy, token_ids=ids, donor_pos=donor_pos
    )
    t0 = time.monotonic()
    w.start_load_kv(SemShareConnectorMetadata(loads=[spec]))
    out = {
        "invalid": sorted(w.get_block_ids_with_load_errors()),
        "recomputes": worker_rpc.take_recomputes(None),
        "stats": dict(w.stats.totals),
        "load_s": time.monotonic() - t0,
    }
    w.shutdown()
    return out


# ---- the scenarios -----------------------------------------------------------------------------
def collectives(rank: int) -> dict:
    from semshare_vllm.vllm_compat import tensor_parallel

    return {
        "rank": tensor_parallel.tp_rank(),
        "one_says_no": tensor_parallel.all_agree(rank == 1),
        "all_say_yes": tensor_parallel.all_agree(True),
        "scores": tensor_parallel.all_reduce_scores(
            torch.tensor([rank + 1.0, 2.0 * rank])
        ).tolist(),
    }


def _drop_donor_on_rank0(w) -> None:
    """Rank 0 lost the donor (evicted, a corrupt file): its load fails, rank 1's does not."""
    from semshare_vllm.core.keys import DonorKey

    if _rank() == 0:
        w.kv.store.drop(DonorKey("", "donor"))


def _boom(what: str):
    def boom(*args, **kwargs):
        raise RuntimeError(f"{what} failed on rank 0")

    return boom


@contextlib.contextmanager
def _on_rank0(module, name: str, value):
    """``module.name`` is ``value`` on rank 0 for the block (the ranks run several scenarios)."""
    original = getattr(module, name)
    if _rank() == 0:
        setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, original)


def _selection_fails_on_rank0(rank: int) -> dict:
    """Rank 0's repair fails before its first collective (the policy cannot be built)."""
    from semshare_vllm.worker import repair

    with _on_rank0(repair, "make_selection", _boom("selection")):
        return _load_once(rank, "cacheblend")


def _attention_fails_on_rank0(rank: int) -> dict:
    """Rank 0's recompute fails inside a layer, between the layer's projections and its
    row-parallel all-reduce (in the attention stand-in)."""
    from semshare_vllm.recompute import layer_runner

    with _on_rank0(layer_runner, "attend_by_position", _boom("attention")):
        return _load_once(rank, "cacheblend")


def _semantic(rank: int, **config) -> dict:
    """A semantic load (each position its donor's), check layer 1: on CPU its move runs beside
    layer 0 and the ranks agree on it before layer 1."""
    return _load_once(
        rank, "cacheblend", donor_pos=list(range(TOKENS)), recompute_check_layer=1, **config
    )


def _semantic_move_fails_on_rank0(rank: int) -> dict:
    """Rank 0's move fails on its side thread while both ranks run layer 0."""
    from semshare_vllm.worker import loads

    with _on_rank0(loads, "move_aligned_rows", _boom("move")):
        return _semantic(rank)


def _rank() -> int:
    from semshare_vllm.vllm_compat import tensor_parallel

    return tensor_parallel.tp_rank()


_STRICT_GATE = dict(
    recompute_check_layer=0,
    recompute_gate_layer=1,
    recompute_error_bound=1e-6,
    recompute_max_share=0.3,
    recompute_attention_window=8,
    recompute_decline_share=1.0,
)

SCENARIOS = {
    "collectives": collectives,
    "cacheblend": lambda rank: _load_once(rank, "cacheblend"),
    "semsharekv": lambda rank: _load_once(rank, "semsharekv", semsharekv_window=8),
    # check layer 0 (capped at 30%), gate at 1, a bound the gate cannot meet: both ranks
    # escalate alike (to every position), or both decline
    "adaptive": lambda rank: _load_once(rank, "adaptive", **_STRICT_GATE),
    "adaptive_declined": lambda rank: _load_once(
        rank, "adaptive", **{**_STRICT_GATE, "recompute_decline_share": 0.5}
    ),
    "exact_load_lost_on_rank0": lambda rank: _load_once(rank, "none", _drop_donor_on_rank0),
    "repaired_load_lost_on_rank0": lambda rank: _load_once(
        rank, "cacheblend", _drop_donor_on_rank0
    ),
    "selection_fails_on_rank0": _selection_fails_on_rank0,
    "semantic": _semantic,
    "semantic_move_fails_on_rank0": _semantic_move_fails_on_rank0,
    "attention_fails_on_rank0": _attention_fails_on_rank0,
}
