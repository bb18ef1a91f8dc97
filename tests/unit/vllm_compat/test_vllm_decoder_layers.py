"""``vllm_compat.decoder_layers``: what the recompute reads of a loaded model (its decoder
layers, their vLLM ``Attention``'s shape and scale, the embedding and final norm), what it
refuses, and the attention stand-in put in and taken out again, on a small stand-in model whose
attention modules are of vLLM's own ``Attention`` class."""

from types import SimpleNamespace

import pytest
import torch

from semshare_vllm.vllm_compat.decoder_layers import (
    UnsupportedModel,
    attention_replaced,
    decoder_stack,
)


def vllm_attention(i, sliding_window=None, soft_cap=None):
    """vLLM's ``Attention`` with the attributes its constructor sets (that needs a whole
    engine config), for layer ``i``."""
    from vllm.model_executor.layers.attention.attention import Attention

    attn = Attention.__new__(Attention)
    torch.nn.Module.__init__(attn)
    attn.layer_name = f"model.layers.{i}.self_attn.attn"
    attn.num_heads, attn.num_kv_heads, attn.head_size = 4, 2, 16
    attn.sliding_window, attn.has_sink = sliding_window, False
    attn.impl = SimpleNamespace(scale=0.25, logits_soft_cap=soft_cap)
    return attn


class SelfAttn(torch.nn.Module):
    def __init__(self, attn):
        super().__init__()
        self.attn = attn

    def forward(self, positions, hidden):
        return self.attn(hidden, hidden, hidden)


class Layer(torch.nn.Module):
    """vLLM's decoder-layer call: (positions, hidden, residual) -> (hidden, residual)."""

    def __init__(self, attn):
        super().__init__()
        self.self_attn = SelfAttn(attn)

    def forward(self, positions, hidden, residual):
        residual = hidden if residual is None else hidden + residual
        return self.self_attn(positions, hidden), residual


class Norm(torch.nn.Module):
    def forward(self, hidden, residual):
        return hidden + residual, hidden + residual


class Inner(torch.nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)
        self.embedding = torch.nn.Embedding(10, 64)
        self.norm = Norm()

    def embed_input_ids(self, ids):
        return self.embedding(ids)


def model(arch="LlamaForCausalLM", attns=None, **inner_attrs):
    cls = type(arch, (torch.nn.Module,), {})
    m = cls()
    m.model = Inner([Layer(a) for a in (attns or [vllm_attention(0), vllm_attention(1)])])
    for k, v in inner_attrs.items():
        setattr(m.model, k, v)
    return m


def test_a_llama_structure_model_as_the_recompute_reads_it():
    m = model()
    stack = decoder_stack(m)
    assert [layer.layer_name for layer in stack.layers] == [
        "model.layers.0.self_attn.attn",
        "model.layers.1.self_attn.attn",
    ]
    first = stack.layers[0]
    assert (first.num_heads, first.num_kv_heads, first.head_size, first.scale) == (4, 2, 16, 0.25)
    assert first.module is m.model.layers[0] and first.attn is m.model.layers[0].self_attn.attn
    assert stack.device == torch.device("cpu")
    ids = torch.tensor([1, 2])
    assert torch.equal(stack.embed(ids), m.model.embedding(ids))
    h, r = torch.ones(2, 64), torch.full((2, 64), 2.0)
    assert torch.equal(stack.final_norm(h, r), h + r)


def test_the_attention_stand_in_is_called_and_always_taken_out_again():
    m = model()
    layer = decoder_stack(m).layers[0]
    original = layer.attn
    seen = []

    class StandIn(torch.nn.Module):
        def forward(self, query, key, value, *args, **kwargs):
            seen.append(query.shape)
            return query * 2

    hidden = torch.ones(3, 64)
    with attention_replaced(layer, StandIn()):
        out, residual = layer(torch.arange(3), hidden, None)
    assert seen == [(3, 64)] and torch.equal(out, hidden * 2) and torch.equal(residual, hidden)
    assert m.model.layers[0].self_attn.attn is original
    with pytest.raises(RuntimeError), attention_replaced(layer, StandIn()):
        raise RuntimeError("the layer failed")
    assert m.model.layers[0].self_attn.attn is original


@pytest.mark.parametrize(
    "make",
    [
        lambda: model("GPT2LMHeadModel"),  # another architecture
        lambda: model(attns=[vllm_attention(0), torch.nn.Identity()]),  # not vLLM's Attention
        lambda: model(attns=[vllm_attention(0, sliding_window=128)]),
        lambda: model(attns=[vllm_attention(0, soft_cap=30.0)]),
        lambda: model(start_layer=1),  # a pipeline stage
    ],
)
def test_what_the_recompute_cannot_drive_is_refused(make):
    with pytest.raises(UnsupportedModel):
        decoder_stack(make())
