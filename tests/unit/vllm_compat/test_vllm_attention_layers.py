"""``vllm_compat.attention_layers``: what the worker reads of each attention layer vLLM built
(backend name, CPU ISA, bound KV views, declared kernel block sizes), on stand-in layers that
carry vLLM's own CPU backend class where one is needed."""

from types import SimpleNamespace

import torch

from semshare_vllm.vllm_compat.attention_layers import KernelBlockSizes, attention_layers


def config(ctx):
    return SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context=ctx))


def test_a_cpu_attn_layer_as_vllm_builds_it():
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    bound = torch.zeros(4, 2, 32, 64)
    layers = attention_layers(
        config(
            {
                "a": SimpleNamespace(attn_backend=CPUAttentionBackend, isa="vec", kv_cache=bound),
                # not bound yet: vLLM's placeholder is an empty tensor
                "b": SimpleNamespace(
                    attn_backend=CPUAttentionBackend, isa="amx", kv_cache=torch.tensor([])
                ),
            }
        ),
        ["a", "b"],
    )
    a, b = layers["a"], layers["b"]
    assert (a.backend, a.cpu_isa) == ("CPU_ATTN", "vec") and a.kv_cache_views[0] is bound
    assert b.cpu_isa == "amx" and b.kv_cache_views == ()
    # CPU_ATTN declares MultipleOf(32)
    assert a.kernel_block_sizes == KernelBlockSizes(multiples_of=(32,))
    assert a.kernel_block_sizes.accepts(128) and not a.kernel_block_sizes.accepts(16)


def test_other_builds_shapes_of_the_same_facts():
    views = [torch.zeros(4, 2, 16, 64), torch.zeros(2, 2, 32)]  # a list; one not 4-D

    def no_sizes():
        raise TypeError("needs the layer's spec")

    backend = SimpleNamespace(
        get_name=lambda: "FLASH_ATTN", get_supported_kernel_block_sizes=lambda: [16, 32, 64]
    )
    layers = attention_layers(
        config(
            {
                "impl_isa": SimpleNamespace(
                    attn_backend=backend, impl=SimpleNamespace(isa="neon"), kv_cache=views
                ),
                "unreachable": SimpleNamespace(
                    attn_backend=SimpleNamespace(
                        get_name=lambda: "X", get_supported_kernel_block_sizes=no_sizes
                    )
                ),
            }
        ),
        ["impl_isa", "unreachable", "missing"],
    )
    first = layers["impl_isa"]
    assert first.cpu_isa == "neon" and first.kv_cache_views == (views[0],)
    assert first.kernel_block_sizes.fixed == (16, 32, 64)
    assert first.kernel_block_sizes.accepts(32) and not first.kernel_block_sizes.accepts(48)
    assert layers["unreachable"].kernel_block_sizes is None
    missing = layers["missing"]  # a layer vLLM did not build: nothing known of it
    assert (
        missing.backend,
        missing.cpu_isa,
        missing.kv_cache_views,
        missing.kernel_block_sizes,
    ) == ("?", None, (), None)
    assert KernelBlockSizes().accepts(7)  # a backend that declares nothing takes any size
