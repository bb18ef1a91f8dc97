"""``vllm_compat.block_hashes`` on vLLM's real ``Request`` and block hasher: every hash a request
with approximate KV has or will get is request-only, wherever its claim starts; and the
scheduler takes failed loads' blocks out of vLLM's prefix cache."""

from types import SimpleNamespace

import pytest
from support.scheduler import BS, Blocks, finish, geometry, request

from semshare_vllm.config import SemShareConfig
from semshare_vllm.scheduler import SemShareScheduler
from semshare_vllm.vllm_compat import block_hashes as vllm_block_hashes


@pytest.fixture(scope="module")
def hasher():
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    init_none_hash(sha256)
    return get_request_block_hasher(BS, sha256)


def vllm_request(hasher, req_id, tokens):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request(req_id, list(tokens), SamplingParams(max_tokens=400), None, block_hasher=hasher)


@pytest.mark.parametrize("prompt_len,start", [(100, 96), (20, 0), (100, 0), (130, 64)])
def test_every_hash_from_the_claim_on_is_request_only_now_and_later(hasher, prompt_len, start):
    tokens = list(range(1000, 1000 + prompt_len))
    served, plain = vllm_request(hasher, "served", tokens), vllm_request(hasher, "plain", tokens)
    vllm_block_hashes.make_request_only(served, start, BS)
    for t in range(200):  # decoding fills the partial block and several more
        served.append_output_token_ids(t)
        plain.append_output_token_ids(t)
    assert len(served.block_hashes) == len(plain.block_hashes) >= 4
    first = start // BS
    assert served.block_hashes[:first] == plain.block_hashes[:first]  # exact: still shared
    for mine, true in zip(served.block_hashes[first:], plain.block_hashes[first:]):
        assert mine != true
    # another request served the same way keeps its own salt
    other = vllm_request(hasher, "other", tokens)
    vllm_block_hashes.make_request_only(other, start, BS)
    for t in range(200):
        other.append_output_token_ids(t)
    assert not set(other.block_hashes[first:]) & set(served.block_hashes[first:])


def test_a_later_claim_starting_earlier_salts_back_to_its_start(hasher):
    tokens = list(range(1000, 1200))
    served, plain = vllm_request(hasher, "served", tokens), vllm_request(hasher, "plain", tokens)
    request_only = vllm_block_hashes.make_request_only
    request_only(served, 128, BS)  # first asked with a 4-block local hit...
    request_only(served, 32, BS)  # ...re-asked once vLLM's hit shrank to one block
    request_only(served, 96, BS)  # (a later start changes nothing)
    for t in range(100):
        served.append_output_token_ids(t)
        plain.append_output_token_ids(t)
    assert served.block_hashes[0] == plain.block_hashes[0]
    assert all(a != b for a, b in zip(served.block_hashes[1:], plain.block_hashes[1:]))
    assert len(served.block_hashes) == len(plain.block_hashes) == 9


class Manager:
    def __init__(self):
        self.evicted: set[int] = set()

    def evict_blocks(self, ids):
        self.evicted |= set(ids)


def claimed_load(block_ids):
    """A scheduler bound to a fake cache manager, and a request it claimed 128 exact tokens
    for, allocated in ``block_ids``."""
    s = SemShareScheduler(SemShareConfig(), geometry())
    manager = Manager()
    s.bind_kv_cache_manager(manager)
    donor = list(range(200))
    finish(s, donor)
    s.build_connector_meta(None)
    target = request("t", donor[:150] + [1, 2, 3])
    assert s.get_num_new_matched_tokens(target, 0) == (128, False)
    s.update_state_after_alloc(target, Blocks(block_ids), 128)
    s.build_connector_meta(None)
    return s, manager, target


def test_a_failed_load_leaves_nothing_in_vllms_prefix_cache_and_its_request_is_no_donor():
    s, manager, target = claimed_load([10, 11, 12, 13, 14])
    # the worker reports the load's second block failed; vLLM keeps it cached ("recompute")
    s.update_connector_output(
        SimpleNamespace(
            finished_sending=None, kv_connector_worker_meta=None, invalid_block_ids={11}
        )
    )
    assert manager.evicted == {11, 12, 13, 14}  # it and every block computed after it
    # aborted before vLLM recomputed it: its KV is not taken as a donor
    target.num_computed_tokens = target.num_tokens - 1
    assert s.request_finished(target, [10, 11, 12, 13, 14])[0] is False


def test_a_load_that_fails_after_its_request_finished_is_still_evicted():
    """With async scheduling a request can finish (abort) between the step that loads it and
    that step's output: the failure reported then still takes its blocks out of vLLM's cache."""
    s, manager, target = claimed_load([20, 21, 22, 23, 24])
    target.num_computed_tokens = 128
    s.request_finished(target, [20, 21, 22, 23, 24])  # aborted: vLLM frees the blocks
    s.update_connector_output(
        SimpleNamespace(
            finished_sending={"done"}, kv_connector_worker_meta=None, invalid_block_ids={20}
        )
    )
    assert manager.evicted == {20, 21, 22, 23, 24}
    for _ in range(5):  # and it is forgotten after
        s.update_connector_output(
            SimpleNamespace(
                finished_sending=None, kv_connector_worker_meta=None, invalid_block_ids=None
            )
        )
    assert not s.load_watch.finished_watched()
