"""Prompt logprobs of a request whose prompt the connector served.

vLLM fills a request's prompt-logprob rows only for the positions it computes. That is why vLLM
turns every prefix cache off for requests that ask for prompt logprobs. A request may still ask
for both through ``kv_transfer_params`` ``{"semshare_reuse_limit": N}`` (scoring a continuation
after a reused prompt): the rows of the positions we served then get a marker, never
uninitialised memory nor a shifted row. A marked row holds the prompt's own next token with
logprob 0.0 and rank 0, a rank vLLM never gives (its ranks start at 1).

Touches two runners' per-request state:
- V1 (``GPUModelRunner`` in ``gpu_model_runner``, and ``CPUModelRunner`` which inherits it):
  ``runner.requests[req_id]`` (a ``CachedRequestState``: ``prompt_token_ids``,
  ``in_progress_prompt_logprobs_cpu``), ``runner.num_prompt_logprobs`` and
  ``vllm.v1.outputs.LogprobsTensors.empty_cpu``, as ``_get_prompt_logprobs_dict`` uses them. It
  allocates the rows with ``torch.empty`` and writes from ``num_computed_tokens`` on.
- V2 (``vllm.v1.worker.gpu.model_runner``, 0.33's GPU default): ``runner.prompt_logprobs_worker``
  (a ``PromptLogprobsWorker``: ``in_progress_prompt_logprobs[req_id]``, a list of chunks it
  concatenates, and ``num_prompt_logprobs[req_idx]``) and ``runner.req_states``
  (``req_id_to_index``, ``all_token_ids.gpu``). It emits rows only from the first computed
  position on, so without a marker chunk in front the rows would be shifted onto the wrong
  prompt tokens.
A load that fails after its rows were marked is recomputed by vLLM from position 0 (a scoring
request reads no cache, so its load starts there, and vLLM rewinds to its first failed block).
By then each runner holds rows it must not keep: V1 dropped the request's prompt-logprob
bookkeeping once the failed step reached the prompt's end (so the recompute would score
nothing), V2 holds the marker chunk and the failed step's rows (so the recompute's rows would
be appended after them). ``restart_rows`` sets both back to a request nothing was computed for.

Written against vLLM 0.32's runners; 0.33's ``PromptLogprobsWorker`` and V1's
``_get_prompt_logprobs_dict`` are the same code. Where neither shape is found, nothing is
marked, the load is reported failed, and vLLM computes and scores the whole prompt.
"""

from __future__ import annotations

import torch


def mark_served_rows(model_runner, req_id: str, until: int) -> bool:
    """Mark rows ``[0, until)`` of the request's prompt logprobs (row ``i`` scores prompt token
    ``i + 1``) before vLLM computes the others. False when this runner keeps no such rows where
    we expect them (another runner version): the caller must then not serve the request."""
    worker = getattr(model_runner, "prompt_logprobs_worker", None)
    if worker is not None:
        return _mark_v2(model_runner, worker, req_id, until)
    return _mark_v1(model_runner, req_id, until)


def _mark_v1(model_runner, req_id: str, until: int) -> bool:
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


def _mark_v2(model_runner, worker, req_id: str, until: int) -> bool:
    chunks = getattr(worker, "in_progress_prompt_logprobs", {}).get(req_id)
    states = getattr(model_runner, "req_states", None)
    req_idx = getattr(states, "req_id_to_index", {}).get(req_id)
    # Nothing may be computed yet (our chunk must come first), and the width of a row must be
    # known now: -1 (the whole vocabulary) is sized by the logits, so it is not served.
    if chunks is None or chunks or req_idx is None:
        return False
    wanted = int(worker.num_prompt_logprobs[req_idx])
    # Fixed-token scoring (``prompt_logprob_token_ids``) is not served: vLLM drops it when a
    # row it scores is not computed, and forgets it once a step reaches the prompt's end, so a
    # failed load could not be scored again.
    if wanted < 0 or req_id in getattr(worker, "token_id_scores", {}):
        return False
    from vllm.v1.outputs import LogprobsTensors

    until = min(until, int(states.prompt_len.np[req_idx]) - 1)
    # the prompt as the runner holds it; on the device, as vLLM's own chunks are (they are
    # concatenated with ours)
    following = states.all_token_ids.gpu[req_idx, 1 : until + 1].to(worker.device, torch.int64)
    chunks.append(
        LogprobsTensors(
            logprob_token_ids=following[:, None].expand(-1, wanted + 1).contiguous(),
            logprobs=torch.zeros(until, wanted + 1, dtype=torch.float32, device=worker.device),
            selected_token_ranks=torch.zeros(until, dtype=torch.int64, device=worker.device),
        )
    )
    return True


def restart_rows(model_runner, req_id: str) -> bool:
    """Forget every prompt-logprob row of ``req_id`` (marked or computed): vLLM computes its
    prompt again from position 0 and must score every row. Call it before that step's forward.
    A request the runner no longer holds has nothing to forget. False when this runner keeps
    no such state where we expect it."""
    worker = getattr(model_runner, "prompt_logprobs_worker", None)
    if worker is not None:
        if not hasattr(worker, "in_progress_prompt_logprobs"):
            return False
        chunks = worker.in_progress_prompt_logprobs.get(req_id)
        if chunks is not None:
            chunks.clear()
        return True
    wanted = getattr(model_runner, "num_prompt_logprobs", None)
    requests = getattr(model_runner, "requests", None)
    if wanted is None or requests is None:
        return False
    state = requests.get(req_id)
    params = getattr(state, "sampling_params", None)
    if state is None or params is None or params.prompt_logprobs is None:
        return True
    # V1 forgets the request once a step reached the end of its prompt (the failed one may
    # have): ask again, as it does when the request is added
    n = params.prompt_logprobs
    wanted[req_id] = model_runner.input_batch.vocab_size if n == -1 else n
    state.in_progress_prompt_logprobs_cpu = None
    return True
