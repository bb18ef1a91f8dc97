"""A donor's identity beyond token ids (``core/identity.py``) and the scheduler keeping donors
within it: the LoRA adapter, multimodal inputs and prompt embeddings, besides the tenant's
cache_salt.
Hand-built requests, no engine (the engine checks are in test_engine_trust.py)."""

from types import SimpleNamespace

from support.scheduler import BS, Blocks, geometry, request

from semshare_vllm.config import SemShareConfig
from semshare_vllm.core.identity import keyable, namespace_of, semantic_allowed, tenant_of
from semshare_vllm.scheduler import SemShareScheduler


def lora(name, path="/adapters/x"):
    return SimpleNamespace(lora_name=name, lora_path=path, lora_int_id=1)


def image(identifier, offset, length=16):
    return SimpleNamespace(
        identifier=identifier, mm_position=SimpleNamespace(offset=offset, length=length)
    )


def with_identity(r, lora_request=None, mm=None, embeds=None):
    r.lora_request, r.mm_features, r.prompt_embeds = lora_request, mm, embeds
    return r


def test_namespaces_are_one_to_one_over_every_identity_vllm_keys_on():
    plain = with_identity(request("a", [1, 2, 3]))
    salted = with_identity(request("a", [1, 2, 3], salt="t1"))
    assert namespace_of(plain) == "" and namespace_of(salted) == "t1"  # persisted donors stay
    spaces = {
        namespace_of(with_identity(request("a", [1], salt=s), lora_request=lo, mm=mm))
        for s in ("", "t1", "-")
        for lo in (None, lora("x"), lora("y"), lora("x", "/other"))
        for mm in (None, [image("h1", 4)], [image("h2", 4)], [image("h1", 8)])
    }
    assert len(spaces) == 3 * 4 * 4
    # a salt crafted to look like an encoded identity never equals that identity
    encoded = namespace_of(with_identity(request("a", [1], salt="t1"), lora_request=lora("x")))
    forged = with_identity(request("a", [1], salt=encoded))
    assert namespace_of(forged) != encoded and namespace_of(forged) not in spaces
    assert tenant_of(encoded) == "t1" and tenant_of("t2") == "t2"


def test_prompt_embeddings_are_never_keyed_and_multimodal_prompts_reuse_exact_prefixes_only():
    assert keyable(with_identity(request("a", [1])))
    assert not keyable(with_identity(request("a", [1]), embeds=object()))
    assert semantic_allowed(with_identity(request("a", [1])))
    assert not semantic_allowed(with_identity(request("a", [1]), mm=[image("h", 0)]))


def _donor(s, tokens, **identity):
    r = with_identity(request("done", tokens, outputs=(7, 8)), **identity)
    r.num_computed_tokens = r.num_tokens - 1
    kept = s.request_finished(r, list(range(100, 100 + r.num_tokens // BS + 1)))
    s.build_connector_meta(None)
    return kept


def test_a_lora_donor_serves_only_its_own_adapter():
    s = SemShareScheduler(SemShareConfig(), geometry())
    donor = list(range(200))
    assert _donor(s, donor, lora_request=lora("x"))[0] is True
    target = donor[:150] + [1, 2, 3]
    assert s.get_num_new_matched_tokens(with_identity(request("t1", target)), 0) == (0, False)
    assert s.get_num_new_matched_tokens(
        with_identity(request("t2", target), lora_request=lora("y")), 0
    ) == (0, False)
    same = with_identity(request("t3", target), lora_request=lora("x"))
    assert s.get_num_new_matched_tokens(same, 0) == (128, False)


def test_multimodal_donors_need_the_same_inputs_in_the_same_places():
    s = SemShareScheduler(SemShareConfig(), geometry())
    donor = list(range(200))
    assert _donor(s, donor, mm=[image("cat", 10)])[0] is True
    target = donor[:150] + [1, 2, 3]
    for mm in (None, [image("dog", 10)], [image("cat", 20)]):
        r = with_identity(request("t", target), mm=mm)
        assert s.get_num_new_matched_tokens(r, 0) == (0, False), mm
    same = with_identity(request("t", target), mm=[image("cat", 10)])
    assert s.get_num_new_matched_tokens(same, 0) == (128, False)


def test_prompt_embedding_requests_are_neither_served_nor_captured():
    s = SemShareScheduler(SemShareConfig(), geometry())
    placeholders = [0] * 200
    assert _donor(s, placeholders, embeds=object())[0] is False  # not captured
    assert len(s.index) == 0
    assert _donor(s, placeholders)[0] is True  # a real prompt of those very ids is
    embeds = with_identity(request("e", placeholders[:150] + [1]), embeds=object())
    assert s.get_num_new_matched_tokens(embeds, 0) == (0, False)  # ...but never serves
    s.update_state_after_alloc(embeds, Blocks(list(range(5))), 0)
    assert s.build_connector_meta(None).loads == []
