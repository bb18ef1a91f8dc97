"""``vllm_compat.prompt_logprobs``: the rows of served prompt positions are marked in the model
runner's per-request state (a stand-in, and vLLM's own ``CachedRequestState``), and forgotten
when the load that served them failed and vLLM computes the prompt again."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from semshare_vllm.vllm_compat.prompt_logprobs import mark_served_rows, restart_rows


def vllm_state(prompt_token_ids):
    from vllm.v1.worker.gpu_input_batch import CachedRequestState

    return CachedRequestState(
        req_id="r",
        prompt_token_ids=prompt_token_ids,
        mm_features=[],
        sampling_params=None,
        generator=None,
        block_ids=([],),
        num_computed_tokens=0,
        output_token_ids=[],
    )


@pytest.mark.parametrize(
    "make_state",
    [
        lambda ids: SimpleNamespace(prompt_token_ids=ids, in_progress_prompt_logprobs_cpu=None),
        vllm_state,
    ],
    ids=["stand-in", "CachedRequestState"],
)
def test_marked_rows_hold_the_prompt_tokens_with_rank_zero(make_state):
    state = make_state([5, 6, 7, 8, 9])
    runner = SimpleNamespace(requests={"r": state}, num_prompt_logprobs={"r": 2})
    assert mark_served_rows(runner, "r", 3)
    rows = state.in_progress_prompt_logprobs_cpu
    assert rows.logprobs.shape == (4, 3)
    assert rows.logprob_token_ids[:3].tolist() == [[6] * 3, [7] * 3, [8] * 3]
    assert rows.logprobs[:3].eq(0).all() and rows.selected_token_ranks[:3].tolist() == [0, 0, 0]
    assert not mark_served_rows(runner, "other", 3)
    assert not mark_served_rows(SimpleNamespace(), "r", 3)


# vLLM's V2 GPU runner (0.33's default) keeps prompt logprobs in a ``PromptLogprobsWorker``
# (0.32 ships the same code). Its two Triton kernels cannot run on this CPU build (vLLM turns
# Triton off without a GPU), so the test stands in torch for them; the bookkeeping that decides
# which rows reach the user (chunks, concatenation, the last-row cut) is vLLM's own.
PROMPT = [5, 6, 7, 8, 9, 10, 11]
VOCAB = 16


def _token_ids_for_rows(num_tokens, query_start_loc, idx_mapping, num_computed, all_token_ids):
    out = torch.empty(num_tokens, dtype=torch.int64)
    for i, req in enumerate(idx_mapping.tolist()):
        lo, hi = query_start_loc[i].item(), query_start_loc[i + 1].item()
        start = num_computed[req].item() + 1  # a row scores the next token
        out[lo:hi] = all_token_ids[req, start : start + hi - lo]
    return out


def _topk_scores(logits, k, token_ids, logits_mode=False):
    from vllm.v1.outputs import LogprobsTensors

    scores = logits if logits_mode else logits.log_softmax(-1)
    ids = torch.cat([token_ids[:, None], logits.topk(k, dim=-1).indices], dim=1)
    own = logits.gather(-1, token_ids[:, None])
    return LogprobsTensors(ids, scores.gather(-1, ids), (logits > own).sum(-1) + 1)


class V2Runner:
    """The two attributes of vLLM's V2 ``GPUModelRunner`` the marker reads, around vLLM's real
    ``PromptLogprobsWorker``."""

    def __init__(self, logprobs, prompt_logprob_start=None):
        from vllm import SamplingParams
        from vllm.v1.worker.gpu.sample.prompt_logprob import PromptLogprobsWorker

        self.prompt_logprobs_worker = PromptLogprobsWorker(4, torch.device("cpu"))
        ids = torch.zeros(4, 32, dtype=torch.int32)
        ids[1, : len(PROMPT)] = torch.tensor(PROMPT)
        self.req_states = SimpleNamespace(
            req_id_to_index={"r": 1},
            all_token_ids=SimpleNamespace(gpu=ids),
            prompt_len=SimpleNamespace(np=np.array([0, len(PROMPT), 0, 0])),
        )
        params = SamplingParams(prompt_logprobs=logprobs, max_tokens=1)
        if prompt_logprob_start is not None:
            params.prompt_logprob_token_ids = np.array([[6], [7]])
            params.prompt_logprob_start = prompt_logprob_start
        self.prompt_logprobs_worker.add_request("r", 1, params)

    def step(self, hidden, computed, scheduled):
        """One forward step over prompt positions ``[computed, computed + scheduled)``."""
        qsl = np.array([0, scheduled], dtype=np.int32)
        batch = SimpleNamespace(
            req_ids=["r"],
            idx_mapping=torch.tensor([1]),
            idx_mapping_np=np.array([1]),
            num_computed_prefill_tokens_np=np.array([computed]),
            prefill_len_np=np.array([len(PROMPT)]),
            num_scheduled_tokens=np.array([scheduled]),
            num_tokens=scheduled,
            query_start_loc=torch.from_numpy(qsl),
            query_start_loc_np=qsl,
        )
        num_computed = torch.zeros(4, dtype=torch.int32)
        num_computed[1] = computed
        return self.prompt_logprobs_worker.compute_prompt_logprobs(
            lambda h: h,
            hidden[computed : computed + scheduled],
            batch,
            self.req_states.all_token_ids.gpu,
            num_computed,
            self.req_states.prompt_len.np,
        )


@pytest.fixture
def v2_kernels(monkeypatch):
    from vllm.v1.worker.gpu.sample import prompt_logprob

    monkeypatch.setattr(prompt_logprob, "get_prompt_logprobs_token_ids", _token_ids_for_rows)
    monkeypatch.setattr(prompt_logprob, "compute_topk_scores", _topk_scores)


def test_v2_runner_rows_of_served_positions_are_marked_and_the_rest_stay_in_place(v2_kernels):
    hidden = torch.randn(len(PROMPT), VOCAB, generator=torch.Generator().manual_seed(0))
    cold = V2Runner(logprobs=2).step(hidden, 0, len(PROMPT))["r"]
    served = 3
    runner = V2Runner(logprobs=2)
    assert mark_served_rows(runner, "r", served)
    warm = runner.step(hidden, served, len(PROMPT) - served)["r"]
    # one row per prompt token after the first, each scoring its own token
    assert warm.logprobs.shape == cold.logprobs.shape == (len(PROMPT) - 1, 3)
    assert warm.logprob_token_ids[:, 0].tolist() == PROMPT[1:]
    assert warm.logprob_token_ids[:served].tolist() == [[t] * 3 for t in PROMPT[1 : served + 1]]
    assert warm.logprobs[:served].eq(0).all() and warm.selected_token_ranks[:served].eq(0).all()
    for got, want in zip(warm, cold, strict=False):
        if got is not None:
            assert torch.equal(got[served:], want[served:])


def test_v2_runner_requests_it_cannot_mark_are_not_served(v2_kernels):
    # the whole vocabulary (-1): the row width comes from the logits, unknown before them
    assert not mark_served_rows(V2Runner(logprobs=-1), "r", 3)
    # fixed-token scores: vLLM drops them where a scored row is not computed, and forgets them
    # once a step reaches the prompt's end (a failed load could not be scored again)
    assert not mark_served_rows(V2Runner(logprobs=1, prompt_logprob_start=1), "r", 3)
    assert not mark_served_rows(V2Runner(logprobs=1, prompt_logprob_start=3), "r", 3)
    assert not mark_served_rows(V2Runner(logprobs=1), "someone-else", 3)
    runner = V2Runner(logprobs=1)
    assert mark_served_rows(runner, "r", 3)
    assert not mark_served_rows(runner, "r", 3)  # rows already there: never twice


@pytest.mark.parametrize("failed_step", ["chunk", "last"])
def test_v2_runner_after_a_failed_load_every_row_is_vllms_own(v2_kernels, failed_step):
    """The load that served rows [0, 3) fails; its step's forward still ran (a chunk, or the
    rest of the prompt, whose rows vLLM emits and its scheduler then drops). vLLM computes the
    prompt again from 0: once the rows are restarted, what it emits is cold's rows."""
    hidden = torch.randn(len(PROMPT), VOCAB, generator=torch.Generator().manual_seed(1))
    cold = V2Runner(logprobs=2).step(hidden, 0, len(PROMPT))["r"]
    runner, served = V2Runner(logprobs=2), 3
    assert mark_served_rows(runner, "r", served)
    runner.step(hidden, served, 2 if failed_step == "chunk" else len(PROMPT) - served)
    assert restart_rows(runner, "r")
    assert runner.step(hidden, 0, 4) == {}  # chunked again
    warm = runner.step(hidden, 4, len(PROMPT) - 4)["r"]
    for got, want in zip(warm, cold, strict=True):
        if want is not None:
            assert torch.equal(got, want)
    assert restart_rows(runner, "gone")  # a request the runner no longer holds: nothing to do
    assert not restart_rows(SimpleNamespace(), "r")  # a runner we do not know


def test_v1_runner_scores_the_prompt_again_after_a_failed_load():
    """vLLM's V1 runner forgets a request's prompt logprobs once a step reached the end of its
    prompt (the failed one may have): restarting asks for them again, with fresh rows."""
    from vllm import SamplingParams

    state = vllm_state(list(range(10)))
    state.sampling_params = SamplingParams(prompt_logprobs=2)
    runner = SimpleNamespace(
        requests={"r": state},
        num_prompt_logprobs={"r": 2},
        input_batch=SimpleNamespace(vocab_size=50),
    )
    assert mark_served_rows(runner, "r", 4)
    assert state.in_progress_prompt_logprobs_cpu is not None
    del runner.num_prompt_logprobs["r"]  # what V1 does once a step reached the prompt's end
    assert restart_rows(runner, "r")
    assert runner.num_prompt_logprobs == {"r": 2} and state.in_progress_prompt_logprobs_cpu is None
    state.sampling_params = SamplingParams(prompt_logprobs=-1)
    assert restart_rows(runner, "r") and runner.num_prompt_logprobs == {"r": 50}
