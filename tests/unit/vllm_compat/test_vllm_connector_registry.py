"""``vllm_compat.connector_registry`` on vLLM's real ``KVConnectorFactory``, and the plugin entry
point that calls it: ``SemShareConnector`` resolves by name, registering again (vLLM runs the
entry point more than once in some processes) is harmless, and the entry point pyproject.toml
declares is the one that registers it and installs the model hook."""

import logging
from importlib.metadata import entry_points

from semshare_vllm import plugin
from semshare_vllm.vllm_compat import connector_registry, model_hook


def test_the_connector_resolves_by_name_and_registering_again_is_harmless(caplog):
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from semshare_vllm.connector import SemShareConnector

    with caplog.at_level(logging.WARNING, logger="vllm.semshare.plugin"):
        connector_registry.register_connector()
        connector_registry.register_connector()
    assert not [r for r in caplog.records if r.name == "vllm.semshare.plugin"]
    assert KVConnectorFactory.get_connector_class_by_name("SemShareConnector") is SemShareConnector


def test_the_declared_entry_point_registers_the_connector_and_installs_the_hook(monkeypatch):
    calls = []
    monkeypatch.setattr(connector_registry, "register_connector", lambda: calls.append("name"))
    monkeypatch.setattr(model_hook, "install", lambda: calls.append("hook"))
    declared = [e for e in entry_points(group="vllm.general_plugins") if e.name == "semshare"]
    assert [e.value for e in declared] == ["semshare_vllm.plugin:register"]
    assert declared[0].load() is plugin.register
    plugin.register()
    assert calls == ["name", "hook"]


def test_inside_a_multiconnector_ours_gives_no_handshake(monkeypatch):
    """vLLM's ``MultiConnector`` hands every connector the first handshake metadata any of them
    gives: ours, listed before NIXL, would reach NIXL's scheduler, which raises and stops the
    engine (the review's reproduction on vLLM 0.32's MultiConnector and NIXL). Ours gives one
    only as the worker's connector itself."""
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer import kv_transfer_state
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    from semshare_vllm.connector import SemShareConnector
    from semshare_vllm.metadata import SemShareHandshake

    ours = object.__new__(SemShareConnector)
    ours.worker = SimpleNamespace(
        geometry=SimpleNamespace(fingerprint="fp", unsupported=None, local_only=None)
    )
    multi = object.__new__(MultiConnector)
    multi._connectors = [ours]
    monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", ours)
    assert ours.get_handshake_metadata() == SemShareHandshake("fp", None)
    monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", multi)
    assert ours.get_handshake_metadata() is None
    assert MultiConnector.get_handshake_metadata(multi) is None
    monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", None)
    assert not connector_registry.serves_alone(ours)
