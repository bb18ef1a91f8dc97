"""vLLM's offline ``LLM`` set up the way the test bed runs it, and a reference runner.

``reference_outputs`` runs the same prompts in a fresh process *without* the connector (vLLM's
own cold computation), so a test can compare against it while its own engine, with the
connector, lives in the test process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Any

BLOCK_SIZE = 32  # CPU attention needs a multiple of 32; small blocks make exact claims tighter


def make_llm(model: str, kv_transfer_config: dict | None = None, **kwargs):
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM
    from vllm.config import KVTransferConfig

    ktc = KVTransferConfig(**kv_transfer_config) if kv_transfer_config else None
    args = dict(
        model=model,
        dtype="float32",
        enforce_eager=True,
        enable_prefix_caching=False,
        max_model_len=4096,
        seed=0,
        block_size=BLOCK_SIZE,
        kv_transfer_config=ktc,
    )
    args.update(kwargs)
    return LLM(**args)


def semshare_llm(model: str, extra_config: dict, **kwargs):
    """``make_llm`` with the SemShare connector and ``extra_config`` as its config."""
    return make_llm(
        model,
        {
            "kv_connector": "SemShareConnector",
            "kv_role": "kv_both",
            "kv_connector_module_path": "semshare_vllm.connector",
            "kv_connector_extra_config": extra_config,
        },
        **kwargs,
    )


def connector_halves(llm):
    """(scheduler half, worker half) of an in-process engine's SemShare connector."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return scheduler_half(llm), get_kv_transfer_group().worker


def drop_connector() -> None:
    """Shut down the KV connector of the in-process engine just released: vLLM keeps its worker
    half in a global that the next engine built in this process would otherwise reuse (with the
    previous engine's geometry and model)."""
    import gc

    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

    gc.collect()
    ensure_kv_transfer_shutdown()


def scheduler_half(llm):
    """The scheduler half of an engine whose engine core runs in this process (its worker halves
    may not: with tensor parallelism they are in the worker processes, ``worker_rpc``)."""
    return llm.llm_engine.engine_core.engine_core.scheduler.connector.scheduler


def run(
    llm,
    prompt: list[int],
    max_tokens: int,
    salt: str | None = None,
    kv_transfer_params: dict | None = None,
    lora_request=None,
) -> dict[str, Any]:
    """One greedy request (token ids), summarised like ``summarize``; ``kv_transfer_params``
    as a client sends them (``{"semshare": "exact"}``: exact-prefix reuse only)."""
    p: dict[str, Any] = {"prompt_token_ids": prompt}
    if salt is not None:
        p["cache_salt"] = salt
    params = greedy(max_tokens, kv_transfer_params=kv_transfer_params)
    out = llm.generate([p], params, lora_request=lora_request, use_tqdm=False)
    return summarize(out)[0]


def greedy(max_tokens: int, logprobs: int | None = 1, kv_transfer_params: dict | None = None):
    from vllm import SamplingParams

    return SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        ignore_eos=True,
        logprobs=logprobs,
        # where vLLM's offline API carries a request's kv_transfer_params
        extra_args=None
        if kv_transfer_params is None
        else {"kv_transfer_params": kv_transfer_params},
    )


def summarize(outputs) -> list[dict[str, Any]]:
    """Token ids and the sampled tokens' logprobs of each output, and what the connector
    answered in its ``kv_transfer_params`` (the request's provenance)."""
    result = []
    for out in outputs:
        comp = out.outputs[0]
        lps = [step[tok].logprob for step, tok in zip(comp.logprobs or [], comp.token_ids)]
        result.append(
            {
                "token_ids": list(comp.token_ids),
                "logprobs": lps,
                "num_cached_tokens": out.num_cached_tokens,
                "kv_transfer_params": out.kv_transfer_params,
            }
        )
    return result


def reference_outputs(model: str, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    """Greedy outputs of ``prompts`` (token ids) from a fresh engine with no KV connector."""
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = os.path.join(tmp, "in.json"), os.path.join(tmp, "out.json")
        with open(src, "w") as f:
            json.dump({"model": model, "prompts": prompts, "max_tokens": max_tokens}, f)
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
        subprocess.run(
            [sys.executable, "-m", __name__, src, dst],
            check=True,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        with open(dst) as f:
            return json.load(f)


def _main(src: str, dst: str) -> None:
    with open(src) as f:
        job = json.load(f)
    llm = make_llm(job["model"])
    prompts = [{"prompt_token_ids": p} for p in job["prompts"]]
    outs = summarize(llm.generate(prompts, greedy(job["max_tokens"]), use_tqdm=False))
    with open(dst, "w") as f:
        json.dump(outs, f)


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2])
