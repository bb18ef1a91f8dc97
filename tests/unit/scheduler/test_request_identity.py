"""A donor's identity beyond token ids (``core/identity.py``) and the scheduler keeping donors
within it: the LoRA adapter, multimodal inputs and prompt embeddings, besides the tenant's
cache_salt.
Hand-built requests, no engine (the engine checks are in test_engine_trust.py)."""

import json
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch
from support.scheduler import BS, Blocks, geometry, request

from semshare_vllm.config import SemShareConfig
from semshare_vllm.core.identity import keyable, namespace_of, semantic_allowed, tenant_of
from semshare_vllm.core.keys import donor_id_for
from semshare_vllm.scheduler import SemShareScheduler
from semshare_vllm.store import donor_file


@pytest.fixture(autouse=True)
def adapters_written_long_ago(monkeypatch):
    """The adapters here are written a moment before they are used: taken as settled (the
    rule for ones that are not has its own test)."""
    monkeypatch.setattr("semshare_vllm.core.identity.recently_changed", lambda path: False)


def lora(name, path="/adapters/x", int_id=1, load_inplace=False):
    return SimpleNamespace(
        lora_name=name, lora_path=path, lora_int_id=int_id, load_inplace=load_inplace
    )


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


def _adapter(path, version: int, keep_stats: bool = False):
    """An adapter directory as PEFT writes one; each version has other bytes. ``keep_stats``:
    the new version's files have the old ones' sizes and mtimes (a copy that normalises
    timestamps)."""
    path.mkdir(parents=True, exist_ok=True)
    files = {
        "adapter_config.json": json.dumps({"r": 8, "version": version}).encode(),
        "adapter_model.safetensors": bytes([version]) * (1000 + (0 if keep_stats else version)),
    }
    for name, data in files.items():
        old = (path / name).stat() if keep_stats and (path / name).exists() else None
        (path / name).write_bytes(data)
        while old is not None and (path / name).stat().st_ctime_ns == old.st_ctime_ns:
            time.sleep(0.005)  # (a coarse kernel clock: the rewrite must be a new version)
            (path / name).write_bytes(data)
        if old is not None:
            assert old.st_size == len(data)
            os.utime(path / name, ns=(old.st_atime_ns, old.st_mtime_ns))
    return str(path)


def test_a_lora_namespace_holds_the_adapter_files_vllm_loaded(tmp_path):
    """vLLM keys its in-memory prefix cache on the adapter's name and path; donors outlive the
    process (persist_dir, the shared index), so theirs also says which files vLLM loaded. Once
    the files change under a running id, vLLM may run either version (it reads them again when
    it loads the id anew): its donors then serve this process only."""

    def namespace(adapter):
        return namespace_of(with_identity(request("r", [1]), lora_request=adapter))

    path = _adapter(tmp_path / "support", 1)
    first = namespace(lora("support", path, int_id=11))
    assert namespace(lora("support", path, int_id=11)) == first  # call after call
    assert namespace(lora("support", path, int_id=12)) == first  # another id, the same files
    _adapter(tmp_path / "support", 2)  # retrained in place
    changed = namespace(lora("support", path, int_id=11))
    assert changed != first  # version 1 or 2: this process only
    assert changed == namespace(lora("support", path, int_id=12))
    retrained = namespace(lora("support", path, int_id=13))  # first seen now: version 2
    assert retrained not in (first, changed) and tenant_of(retrained) == ""
    inplace = namespace(lora("support", path, int_id=13, load_inplace=True))
    assert inplace == changed  # reloaded at a moment not seen here: this process only


def test_an_adapter_is_known_by_the_content_of_the_files_vllm_reads(tmp_path, monkeypatch):
    """adapter_config.json and adapter_model.* by content; a trainer's files beside them by
    stats (never read in full); one whose content cannot be read: this process only."""
    from semshare_vllm.core import file_digest, identity

    path = _adapter(tmp_path / "ckpt", 1)
    (tmp_path / "ckpt" / "optimizer.pt").write_bytes(b"\x01" * 64)
    read = []
    real = file_digest.digest
    monkeypatch.setattr("semshare_vllm.core.files.digest", lambda p: read.append(p.name) or real(p))
    files = identity._files_now(path)
    assert sorted(read) == ["adapter_config.json", "adapter_model.safetensors"]
    assert files["others"] == [["optimizer.pt", 64]]  # (name and size: never read)
    monkeypatch.setattr(
        "semshare_vllm.core.files.digest",
        lambda p: None if p.name == "adapter_model.safetensors" else real(p),
    )
    assert identity._files_now(path) == {"process": identity._THIS_PROCESS}


def test_an_adapter_written_a_moment_ago_keys_donors_to_this_process_only(tmp_path, monkeypatch):
    """Its version could still change within the kernel clock's tick, and its digest would be
    read again at every request: not read at all, this process only."""
    from semshare_vllm.core import file_digest, identity

    monkeypatch.setattr(identity, "recently_changed", file_digest.recently_changed)
    path = _adapter(tmp_path / "fresh", 1)
    monkeypatch.setattr("semshare_vllm.core.files.digest", lambda p: pytest.fail("read"))
    assert identity._files_now(path) == {"process": identity._THIS_PROCESS}
    monkeypatch.setattr(file_digest, "RACY_S", 0.0)
    monkeypatch.setattr("semshare_vllm.core.files.digest", lambda p: "d" * 64)
    assert "files" in identity._files_now(path)


def test_a_lora_adapter_whose_files_cannot_be_read_keys_donors_to_this_process_only():
    """A path that is neither a local directory nor a cached hub snapshot (a resolver's URL):
    its donors serve this process only, never another instance or a restart."""
    code = (
        "from types import SimpleNamespace as S; from semshare_vllm.core.identity import "
        "namespace_of; print(namespace_of(S(cache_salt=None, mm_features=None, "
        "lora_request=S(lora_name='x', lora_path='s3://adapters/x', lora_int_id=1))))"
    )
    here = namespace_of(with_identity(request("a", [1]), lora_request=lora("x", "s3://adapters/x")))
    assert here == namespace_of(
        with_identity(request("b", [1]), lora_request=lora("x", "s3://adapters/x"))
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    other = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    ).stdout.strip()
    assert other and other != here


@pytest.mark.parametrize("keep_stats", [False, True], ids=["rewritten", "same-sizes-and-mtimes"])
def test_a_persisted_lora_donor_is_not_served_after_its_adapter_changed(tmp_path, keep_stats):
    """A donor of adapter v1 written to persist_dir, the adapter retrained at the same path, the
    engine restarted: the donor's KV came from other weights and is not claimed; with the
    adapter unchanged it is. Also when the new files have the old ones' sizes and mtimes."""
    path = _adapter(tmp_path / "adapters" / "support", 1, keep_stats)

    def req(rid, tokens, int_id=21):
        return with_identity(request(rid, tokens), lora_request=lora("support", path, int_id))

    g = geometry()
    tokens = list(range(200))
    namespace = namespace_of(req("d", tokens))
    donor_id = donor_id_for(namespace, tokens)
    root = tmp_path / "persist" / g.fingerprint
    donor_file.write(
        donor_file.donor_path(root, donor_id, 0, 1),
        namespace,
        donor_id,
        tokens,
        list(g.layer_names),
        "L",
        torch.zeros(len(g.layer_names), 2, len(tokens), 2, 8),
    )
    target = tokens[:150] + [9, 9, 9]
    config = SemShareConfig(persist_dir=str(tmp_path / "persist"), embedder="none")
    unchanged = SemShareScheduler(config, g)  # (another id: as a restarted engine sees it)
    assert unchanged.get_num_new_matched_tokens(req("t1", target, 22), 0) == (128, False)

    _adapter(tmp_path / "adapters" / "support", 2, keep_stats)
    restarted = SemShareScheduler(config, g)
    assert restarted.stats.totals["donors_restored"] == 1
    assert restarted.get_num_new_matched_tokens(req("t2", target, 23), 0) == (0, False)


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
