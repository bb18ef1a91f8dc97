"""The recompute's attention on a GPU: scattered queries over a whole context, one layer.

Off vLLM's CPU backend (on CUDA, under every GPU attention backend) a recomputed layer's
queries, a share r of the prompt's positions in order, attend over every position's K/V read
back from the paged cache (``kernels.attend_by_position``). Measured here on a
Qwen2.5-7B-shaped layer (28 query heads, 4 KV heads, head 128, bf16), against the layer's
attention in a cold prefill (every position, SDPA ``is_causal``):

* ``attend_by_position`` as shipped (on CUDA the Triton kernel);
* its torch version (masked SDPA in ``attend_chunks`` calls), and the same in eight chunks
  (CPU's count, which GPUs took before);
* ``flex_attention`` compiled, its block mask made once before the timing (a fused kernel
  with no mask-making cost: a bar to compare with);

each checked against the torch version in fp32 (max abs difference). Median of
``--repeats``, CUDA events; on a machine without CUDA it runs small on CPU (to check the
script; the kernel then is the torch version).

    python3 benchmarks/recompute_attention.py [--tokens 2048 8192 32768] [--shares 0.1 0.3]
"""

from __future__ import annotations

import argparse

import torch

from semshare_vllm.kernels import position_attention
from semshare_vllm.kernels.position_attention import (
    attend_by_position,
    attend_by_position_reference,
)
from semshare_vllm.testbed.timing import median_ms

HQ, HKV, D = 28, 4, 128


def chunked(chunks: int):
    """The torch version in ``chunks`` masked calls, whatever ``attend_chunks`` would choose."""

    def fn(q, k, v, q_pos, scale):
        shipped = position_attention.attend_chunks
        position_attention.attend_chunks = lambda *a: chunks
        try:
            return attend_by_position_reference(q, k, v, q_pos, scale)
        finally:
            position_attention.attend_chunks = shipped

    return fn


def flex_kept_mask():
    """``flex_attention`` compiled, the block mask made on the first call per inputs and kept."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled = torch.compile(flex_attention, dynamic=True)
    masks = {}

    def fn(q, k, v, q_pos, scale):
        key = (q.shape[0], k.shape[0], q_pos.data_ptr())
        if key not in masks:
            masks[key] = create_block_mask(
                lambda b, h, q_idx, kv_idx: kv_idx <= q_pos[q_idx],
                None,
                None,
                q.shape[0],
                k.shape[0],
                device=q.device,
            )
        out = compiled(
            *(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)),
            block_mask=masks[key],
            scale=scale,
            enable_gqa=True,
        )
        return out[0].transpose(0, 1)

    return fn


def run(tokens: int, share: float, repeats: int, device: str, variants) -> list[str]:
    g = torch.Generator().manual_seed(0)
    scale = D**-0.5
    k = torch.randn(tokens, HKV, D, generator=g).to(device, torch.bfloat16)
    v = torch.randn(tokens, HKV, D, generator=g).to(device, torch.bfloat16)
    q_all = torch.randn(tokens, HQ, D, generator=g).to(device, torch.bfloat16)
    chosen = torch.randperm(tokens - 32, generator=g)[: int(share * tokens)]
    q_pos = torch.cat((chosen.sort().values, torch.arange(tokens - 32, tokens))).to(device)
    q = q_all[q_pos]
    want = attend_by_position_reference(q.float(), k.float(), v.float(), q_pos, scale)
    cells = []
    for fn in variants:
        ms = median_ms(lambda f=fn: f(q, k, v, q_pos, scale), repeats, device)
        err = (fn(q, k, v, q_pos, scale).float() - want).abs().max().item()
        cells.append(f"{ms:.3f} ms (err {err:.2g})")
    everything = torch.arange(tokens, device=device)
    cold = median_ms(lambda: attend_by_position(q_all, k, v, everything, scale), repeats, device)
    return [str(tokens), f"{share:.0%}", str(len(q_pos)), *cells, f"{cold:.3f} ms"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    cuda = torch.cuda.is_available()
    parser.add_argument(
        "--tokens", type=int, nargs="+", default=[2048, 8192, 32768] if cuda else [512]
    )
    parser.add_argument("--shares", type=float, nargs="+", default=[0.1, 0.3])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    device = "cuda" if cuda else "cpu"
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name() if cuda else 'CPU'}")
    variants = [attend_by_position, attend_by_position_reference, chunked(8)]
    names = ["shipped", "torch version", "torch, 8 chunks"]
    if cuda:
        variants.append(flex_kept_mask())
        names.append("flex_attention, mask made before")
    print(
        f"\n### One layer's attention, {HQ} query heads, {HKV} KV heads, head {D}, bf16 "
        f"(median of {args.repeats})\n"
    )
    print(
        "| context | share | queries | " + " | ".join(names) + " | cold: every position, causal |"
    )
    print("|---|---|---|" + "---|" * len(names) + "---|")
    for tokens in args.tokens:
        for share in args.shares:
            print("| " + " | ".join(run(tokens, share, args.repeats, device, variants)) + " |")


if __name__ == "__main__":
    main()
