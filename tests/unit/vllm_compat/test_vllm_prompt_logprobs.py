"""``vllm_compat.prompt_logprobs``: the rows of served prompt positions are marked in the model
runner's per-request state (a stand-in, and vLLM's own ``CachedRequestState``)."""

from types import SimpleNamespace

import pytest

from semshare_vllm.vllm_compat.prompt_logprobs import mark_served_rows


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
