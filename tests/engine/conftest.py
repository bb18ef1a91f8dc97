"""Fixtures shared by the engine tests (module scope: each module builds its own engine).

``model`` is SmolLM2-135M unless a module overrides it (the tiny random Llama, or both); ``tok``
is the tokenizer of whichever ``model`` the module uses."""

import pytest

from semshare_vllm.testbed import models, offline


@pytest.fixture(scope="module")
def model():
    return str(models.smollm2())


@pytest.fixture(scope="module")
def tok(model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


@pytest.fixture(scope="module", autouse=True)
def _one_kv_connector_per_module():
    """vLLM keeps an in-process engine's worker-side connector in a global, which the next
    engine reuses if it is still set: each module's engine must leave with its connector (else
    the next module's engine runs with the previous one's worker half, e.g. its geometry)."""
    yield
    offline.drop_connector()
