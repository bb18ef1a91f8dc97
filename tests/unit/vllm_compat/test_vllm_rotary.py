"""``vllm_compat.rotary``: vLLM's own rotary modules read as one fp32 angle table (YaRN's
magnitude divided out), the modules that are not one table refused, and a loaded model's rotary
module found. (The table against each module's own forward: tests/unit/kernels.)"""

from types import SimpleNamespace

import pytest
import torch

from semshare_vllm.vllm_compat.rotary import (
    UnsupportedRope,
    model_rotary_embedding,
    rotary_angles,
)


@pytest.fixture(scope="module", autouse=True)
def vllm_config():
    """vLLM's CustomOp modules read the current config when built."""
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):
        yield


def get_rope(head=64, neox=True, params=None, dtype=torch.float32):
    from vllm.model_executor.layers.rotary_embedding import get_rope as vllm_get_rope

    return vllm_get_rope(head, 2048, is_neox_style=neox, rope_parameters=params, dtype=dtype)


def test_a_plain_table_is_vllms_own_in_fp32():
    rope = get_rope(neox=False, params={"rope_type": "default", "partial_rotary_factor": 0.5})
    angles = rotary_angles(rope)
    assert (angles.head_size, angles.rotary_dim, angles.is_neox) == (64, 32, False)
    assert angles.cos_sin.dtype == torch.float32 and angles.cos_sin.shape == (2048, 32)
    assert torch.equal(angles.cos_sin, rope.cos_sin_cache.float())


def test_yarns_magnitude_is_divided_out_of_a_bf16_modules_fp32_table():
    rope = get_rope(
        params={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512},
        dtype=torch.bfloat16,
    )
    assert rope.mscale > 1.1 and rope.cos_sin_cache.dtype == torch.bfloat16
    cos, sin = rotary_angles(rope).cos_sin.split(32, dim=1)
    assert torch.equal(cos[0], torch.ones(32)) and torch.equal(sin[0], torch.zeros(32))
    torch.testing.assert_close(cos * cos + sin * sin, torch.ones_like(cos), rtol=0, atol=1e-6)


def test_modules_that_are_not_one_table_are_refused():
    from vllm.model_executor.layers.rotary_embedding import LinearScalingRotaryEmbedding

    mrope = get_rope(128, params={"rope_type": "default", "mrope_section": [16, 24, 24]})
    with pytest.raises(UnsupportedRope):
        rotary_angles(mrope)
    with pytest.raises(UnsupportedRope):
        rotary_angles(
            LinearScalingRotaryEmbedding(64, 64, 256, 10000, True, [1.0, 2.0], torch.float32)
        )


def test_a_models_rotary_module():
    rope = get_rope()
    layer = SimpleNamespace(self_attn=SimpleNamespace(rotary_emb=rope))
    model = SimpleNamespace(model=SimpleNamespace(layers=[layer, layer]))
    assert model_rotary_embedding(model) is rope
    with pytest.raises(UnsupportedRope):
        model_rotary_embedding(SimpleNamespace(model=SimpleNamespace(layers=[])))
