"""``vllm_compat.prefix_cache_flags`` on vLLM's real ``Request`` and ``KVCacheManager`` check:
vLLM sets the flag for prompt-logprob requests; letting the connector's claim through clears it
(vLLM's check right after asking the connector reads it), and restoring sets it back so that
vLLM's own prefix cache stays unread for the request."""

from types import SimpleNamespace

from semshare_vllm.vllm_compat.prefix_cache_flags import (
    allow_connector_claim,
    restore_cache_skip,
    wants_cache_skip,
)


def vllm_request(**sampling):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request("r", list(range(100)), SamplingParams(max_tokens=4, **sampling), None)


def lookup_enabled(request) -> bool:
    """vLLM's own answer to "may the local prefix cache be read for this request"."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    return KVCacheManager.prefix_cache_lookup_enabled(SimpleNamespace(enable_caching=True), request)


def test_a_prompt_logprobs_request_is_let_through_once_and_set_back():
    r = vllm_request(prompt_logprobs=0)
    assert wants_cache_skip(r) and r.skip_reading_prefix_cache and not lookup_enabled(r)
    allow_connector_claim(r)
    assert not r.skip_reading_prefix_cache and not wants_cache_skip(r)
    restore_cache_skip(r)
    assert r.skip_reading_prefix_cache and wants_cache_skip(r) and not lookup_enabled(r)


def test_requests_that_read_caches_do_not_skip():
    plain = vllm_request()
    assert not wants_cache_skip(plain) and lookup_enabled(plain)
    assert not wants_cache_skip(SimpleNamespace())  # a request without the flag
