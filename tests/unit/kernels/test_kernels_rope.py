"""RoPE correction against vLLM's own rotary modules: a key rotated by the module at position p,
corrected to q, equals the key the module rotates at q directly, for every scaling family."""

import pytest
import torch

from semshare_vllm.kernels.rope import (
    RopeTable,
    UnsupportedRope,
    correct_rope,
    rope_correct_reference,
)

HEAD = 64
MAX_POS = 2048

# name -> (is_neox_style, rope_parameters) as a model config hands them to get_rope
ROPES = {
    "neox": (True, None),
    "gptj": (False, None),
    "partial": (True, {"rope_type": "default", "partial_rotary_factor": 0.5}),
    "partial_gptj": (False, {"rope_type": "default", "partial_rotary_factor": 0.25}),
    "linear": (True, {"rope_type": "linear", "factor": 2.0}),
    "ntk": (True, {"rope_type": "ntk", "factor": 2.0}),
    "dynamic": (True, {"rope_type": "dynamic", "factor": 2.0}),
    "dynamic_alpha": (True, {"rope_type": "dynamic", "alpha": 2.0}),
    "llama3": (
        True,
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 512,
            "rope_theta": 500000.0,
        },
    ),
    "yarn": (True, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}),
    "deepseek_yarn": (
        False,
        {
            "rope_type": "deepseek_yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 512,
            "mscale": 1.0,
            "mscale_all_dim": 0.0,
        },
    ),
}


@pytest.fixture(scope="module")
def vllm_config():
    """vLLM's CustomOp modules read the current config when built."""
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):
        yield


def make_rope(name, dtype, head=HEAD, **extra):
    from vllm.model_executor.layers.rotary_embedding import get_rope

    neox, params = ROPES[name]
    return get_rope(head, MAX_POS, is_neox_style=neox, rope_parameters=params, dtype=dtype, **extra)


def rotated_keys(rope, k0, pos):
    """The module's own forward: the key it would cache at ``pos``."""
    _, key = rope.forward_native(pos, torch.zeros_like(k0), k0.clone())
    return key


def positions(table, count, seed):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randint(0, table.max_position, (count,), generator=g),
        torch.randint(0, table.max_position, (count,), generator=g),
    )


@pytest.mark.parametrize("name", sorted(ROPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_correction_matches_module_at_target(vllm_config, name, dtype):
    rope = make_rope(name, dtype)
    table = RopeTable.from_vllm(rope)
    k0 = torch.randn(160, 2, HEAD, generator=torch.Generator().manual_seed(1)).to(dtype)
    src, dst = positions(table, 160, seed=2)
    out = rope_correct_reference(rotated_keys(rope, k0, src), src, dst, table)
    want = rotated_keys(rope, k0, dst)
    assert out.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    else:  # the module itself rotates in bf16 with a bf16 table: each product is rounded at
        # the scale of the key, so allow one bf16 step (2^-7 relative) of the largest entry.
        step = 2**-7 * want.abs().max().item()
        torch.testing.assert_close(out, want, rtol=1.6e-2, atol=step)


@pytest.mark.parametrize("name", ["neox", "gptj", "yarn"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_same_position_is_bit_identical(vllm_config, name, dtype):
    table = RopeTable.from_vllm(make_rope(name, torch.float32))
    k = torch.randn(50, 3, HEAD).to(dtype)
    src, dst = positions(table, 50, seed=3)
    dst[::2] = src[::2]
    out = rope_correct_reference(k, src, dst, table)
    assert torch.equal(out[::2], k[::2])
    assert not torch.equal(out[1::2], k[1::2])
    assert torch.equal(rope_correct_reference(k, src, src, table), k)


def test_table_is_fp32_unit_rotation_even_for_bf16_yarn(vllm_config):
    rope = make_rope("yarn", torch.bfloat16)
    assert rope.cos_sin_cache.dtype == torch.bfloat16 and rope.mscale > 1.1
    table = RopeTable.from_vllm(rope)
    assert table.cos_sin.dtype == torch.float32
    cos, sin = table.cos_sin.split(table.half, dim=1)
    assert torch.equal(cos[0], torch.ones(table.half))
    assert torch.equal(sin[0], torch.zeros(table.half))
    torch.testing.assert_close(cos * cos + sin * sin, torch.ones_like(cos), rtol=0, atol=1e-6)
    # ...and it is the fp32 table, not the bf16 buffer (recomputed, then only divided by mscale)
    fp32_table = RopeTable.from_vllm(make_rope("yarn", torch.float32))
    assert torch.equal(table.cos_sin, fp32_table.cos_sin)


def test_partial_rotary_passes_tail_dims_through(vllm_config):
    table = RopeTable.from_vllm(make_rope("partial", torch.float32))
    assert table.rotary_dim == HEAD // 2
    k = torch.randn(20, 2, HEAD)
    src, dst = positions(table, 20, seed=4)
    out = rope_correct_reference(k, src, dst, table)
    assert torch.equal(out[..., table.rotary_dim :], k[..., table.rotary_dim :])


def test_value_is_never_rotated(vllm_config):
    """Through the fused move, K is corrected and V lands bit for bit."""
    from semshare_vllm.kernels.gather_rearrange import gather_rearrange_reference
    from semshare_vllm.layout.specs import page_spec

    rope = make_rope("neox", torch.float32)
    table = RopeTable.from_vllm(rope)
    k0, v = torch.randn(24, 2, HEAD), torch.randn(24, 2, HEAD)
    src_pos, dst_pos = positions(table, 24, seed=5)
    staged = torch.cat((rotated_keys(rope, k0, src_pos), v), dim=-1)[None]  # [1, T, H, 2D]
    cache = torch.zeros(4, 2, 8, 2 * HEAD)
    slots = torch.randperm(32)[:24]
    gather_rearrange_reference(
        staged,
        torch.arange(24),
        slots,
        [cache],
        page_spec("FLASH_ATTN", HEAD).offsets(cache),
        table,
        src_pos,
        dst_pos,
    )
    k_out = cache[slots // 8, :, slots % 8, :HEAD]
    v_out = cache[slots // 8, :, slots % 8, HEAD:]
    assert torch.equal(v_out, v)
    torch.testing.assert_close(k_out, rotated_keys(rope, k0, dst_pos), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dispatcher_torch_path_and_in_place(vllm_config, dtype):
    table = RopeTable.from_vllm(make_rope("gptj", torch.float32))
    k = torch.randn(30, 2, HEAD).to(dtype)
    src, dst = positions(table, 30, seed=6)
    want = rope_correct_reference(k, src, dst, table)
    assert torch.equal(correct_rope(k, src, dst, table, impl="torch"), want)
    in_place = k.clone()
    assert correct_rope(in_place, src, dst, table, out=in_place, impl="torch") is in_place
    assert torch.equal(in_place, want)


def test_unsupported_rotary_modules_are_refused(vllm_config):
    from vllm.model_executor.layers.rotary_embedding import (
        LinearScalingRotaryEmbedding,
        get_rope,
    )

    mrope = get_rope(
        128,
        MAX_POS,
        rope_parameters={"rope_type": "default", "mrope_section": [16, 24, 24]},
        dtype=torch.float32,
    )
    assert type(mrope).__name__ == "MRotaryEmbedding"
    with pytest.raises(UnsupportedRope):
        RopeTable.from_vllm(mrope)
    multi_lora = LinearScalingRotaryEmbedding(
        HEAD, HEAD, 256, 10000, True, [1.0, 2.0], torch.float32
    )
    with pytest.raises(UnsupportedRope):
        RopeTable.from_vllm(multi_lora)
