"""Prompt logprobs of a request whose prompt the connector served.

vLLM fills a request's prompt-logprob rows only for the positions it computes: the V1 model
runner allocates them with ``torch.empty`` and writes from ``num_computed_tokens`` on. That is
why vLLM turns every prefix cache off for requests that ask for prompt logprobs. A request may
still ask for both through ``kv_transfer_params`` ``{"semshare_reuse_limit": N}`` (scoring a
continuation after a reused prompt): the rows of the positions we served then get a marker, never
uninitialised memory. A marked row holds the prompt's own next token with logprob 0.0 and rank 0,
a rank vLLM never gives (its ranks start at 1).

Touches the V1 model runner's per-request state: ``runner.requests[req_id]`` (a
``CachedRequestState``: ``prompt_token_ids``, ``in_progress_prompt_logprobs_cpu``),
``runner.num_prompt_logprobs`` and ``vllm.v1.outputs.LogprobsTensors.empty_cpu``, as
``GPUModelRunner._get_prompt_logprobs_dict`` uses them (``CPUModelRunner`` inherits it).
Written against vLLM 0.32's V1 runners. 0.33's V2 GPU runner (its GPU default) keeps prompt
logprobs elsewhere (``prompt_logprobs_worker``): there nothing is marked, the load is reported
failed, and vLLM computes and scores the whole prompt.
"""

from __future__ import annotations

import torch


def mark_served_rows(model_runner, req_id: str, until: int) -> bool:
    """Mark rows ``[0, until)`` of the request's prompt logprobs (row ``i`` scores prompt token
    ``i + 1``) before vLLM computes the others. False when this runner keeps no such rows where
    we expect them (another runner version): the caller must then not serve the request."""
    state = getattr(model_runner, "requests", {}).get(req_id)
    wanted = getattr(model_runner, "num_prompt_logprobs", {}).get(req_id)
    if (
        state is None
        or wanted is None
        or not hasattr(state, "in_progress_prompt_logprobs_cpu")
        or state.prompt_token_ids is None
    ):
        return False
    from vllm.v1.outputs import LogprobsTensors

    rows = state.in_progress_prompt_logprobs_cpu
    if rows is None:
        rows = LogprobsTensors.empty_cpu(len(state.prompt_token_ids) - 1, wanted + 1)
        state.in_progress_prompt_logprobs_cpu = rows
    until = min(until, rows.logprobs.shape[0])
    following = torch.as_tensor(state.prompt_token_ids[1 : until + 1], dtype=torch.int32)
    rows.logprob_token_ids[:until] = following[:, None]
    rows.logprobs[:until] = 0.0
    rows.selected_token_ranks[:until] = 0
    return True
