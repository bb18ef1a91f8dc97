"""Fixtures shared by the engine tests (module scope: each module builds its own engine).

``model`` is SmolLM2-135M unless a module overrides it (the tiny random Llama, or both); ``tok``
is the tokenizer of whichever ``model`` the module uses."""

import pytest

from semshare_vllm.testbed import models


@pytest.fixture(scope="module")
def model():
    return str(models.smollm2())


@pytest.fixture(scope="module")
def tok(model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)
