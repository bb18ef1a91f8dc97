"""The recompute's attention on a GPU: scattered queries over a whole context, one layer.

Off vLLM's CPU backend (on CUDA, under every GPU attention backend) a recomputed layer's
queries, a share r of the prompt's positions in order, attend over every position's K/V read
back from the paged cache (``recompute.layer_runner.attend``: torch SDPA with a causal mask by
position, in chunks). A masked SDPA call has fewer fused kernels to choose from than a causal
one; which one runs, and at what cost against the layer's attention in a cold prefill (every
position, ``is_causal``), is measured here on a Qwen2.5-7B-shaped layer (28 query heads, 4 KV
heads, head 128, bf16):

* ``attend`` as shipped (``attend_chunks`` masked calls), in eight chunks (CPU's count, which
  GPUs took before), and with the KV heads expanded to the query heads (no ``enable_gqa``);
  on CUDA also with one SDPA backend forced: memory-efficient (expanded: it takes no GQA),
  math;
* the cold layer's causal attention over all positions;
* per SDPA backend forced alone, whether it takes the masked call at all;
* a candidate: ``flex_attention`` compiled, with a block mask from the positions (made per
  call by ``create_block_mask`` compiled, and made once before the timing);

each checked against ``attend`` in fp32 (max abs difference). Median of ``--repeats``, CUDA
events; on a machine without CUDA it runs small on CPU (to check the script).

    python3 benchmarks/recompute_attention.py [--tokens 8192 32768] [--shares 0.1 0.3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from semshare_vllm.recompute import layer_runner
from semshare_vllm.recompute.layer_runner import attend

HQ, HKV, D = 28, 4, 128
FLEX_COMPILED_MASK = FLEX_KEPT_MASK = None  # flex_attend(...), built on CUDA


def chunked(chunks: int):
    """``attend`` in ``chunks`` masked calls, whatever ``attend_chunks`` would choose."""

    def fn(q, k, v, q_pos, scale):
        shipped = layer_runner.attend_chunks
        layer_runner.attend_chunks = lambda *a: chunks
        try:
            return attend(q, k, v, q_pos, scale)
        finally:
            layer_runner.attend_chunks = shipped

    return fn


def timed(fn, repeats: int, device: str) -> float:
    """Median milliseconds of ``fn`` after a warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(stop))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def expanded_attend(q, k, v, q_pos, scale):
    """``attend`` over KV heads repeated to the query heads' count (no GQA in the call)."""
    group = q.shape[1] // k.shape[1]
    return attend(
        q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1), q_pos, scale
    )


def flex_attend(compile_mask: bool = False, masks: dict | None = None):
    """A candidate (CUDA): the same attention by ``flex_attention`` compiled, its block mask
    from the query positions (blocks wholly before a chunk's first position need no mask).
    ``masks``: where given, the block mask is made once per shape and kept there (to time
    the attention without the mask's making)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled = torch.compile(flex_attention, dynamic=True)

    def fn(q, k, v, q_pos, scale):
        def causal(b, h, q_idx, kv_idx):
            return kv_idx <= q_pos[q_idx]

        key = (q.shape[0], k.shape[0], q_pos.data_ptr())
        mask = masks.get(key) if masks is not None else None
        if mask is None:
            mask = create_block_mask(
                causal, None, None, q.shape[0], k.shape[0], device=q.device, _compile=compile_mask
            )
            if masks is not None:
                masks[key] = mask
        out = compiled(
            *(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)),
            block_mask=mask,
            scale=scale,
            enable_gqa=True,
        )
        return out[0].transpose(0, 1)

    return fn


def masked_backends(q, k, v, q_pos, scale) -> dict[str, str]:
    """Which SDPA backend takes one of ``attend``'s masked chunks (GQA and expanded)."""
    m = int(q_pos[-1]) + 1
    mask = torch.arange(m, device=q.device)[None, :] <= q_pos[:, None]
    out = {}
    for backend in (
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
        SDPBackend.CUDNN_ATTENTION,
        SDPBackend.MATH,
    ):
        cells = []
        for name, kk, vv in (
            ("gqa", k[:m], v[:m]),
            ("expanded", *(t[:m].repeat_interleave(HQ // HKV, dim=1) for t in (k, v))),
        ):
            try:
                with sdpa_kernel([backend]):
                    layer_runner._sdpa(q, kk, vv, mask, scale)
                cells.append(f"{name} ok")
            except RuntimeError as exc:
                cells.append(f"{name} refused ({str(exc).splitlines()[0][:60]})")
        out[backend.name] = ", ".join(cells)
    return out


def run(tokens: int, share: float, repeats: int, device: str) -> list[str]:
    g = torch.Generator().manual_seed(0)
    scale = D**-0.5
    k = torch.randn(tokens, HKV, D, generator=g).to(device, torch.bfloat16)
    v = torch.randn(tokens, HKV, D, generator=g).to(device, torch.bfloat16)
    q_all = torch.randn(tokens, HQ, D, generator=g).to(device, torch.bfloat16)
    chosen = torch.randperm(tokens - 32, generator=g)[: int(share * tokens)]
    q_pos = torch.cat((chosen.sort().values, torch.arange(tokens - 32, tokens))).to(device)
    q = q_all[q_pos]
    want = attend(q.float(), k.float(), v.float(), q_pos, scale)
    cells = []
    variants = [(attend, None), (chunked(8), None), (expanded_attend, None)]
    if device == "cuda":
        variants += [
            (expanded_attend, SDPBackend.EFFICIENT_ATTENTION),
            (attend, SDPBackend.MATH),
            (FLEX_COMPILED_MASK, None),
            (FLEX_KEPT_MASK, None),
        ]
    for fn, backend in variants:

        def call(f=fn, b=backend):
            if b is None:
                return f(q, k, v, q_pos, scale)
            with sdpa_kernel([b]):
                return f(q, k, v, q_pos, scale)

        ms = timed(call, repeats, device)
        err = (call().float() - want).abs().max().item()
        cells.append(f"{ms:.3f} ms (err {err:.2g})")
    everything = torch.arange(tokens, device=device)
    cold = timed(lambda: attend(q_all, k, v, everything, scale), repeats, device)
    return [str(tokens), f"{share:.0%}", str(len(q_pos)), *cells, f"{cold:.3f} ms"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    cuda = torch.cuda.is_available()
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768] if cuda else [512])
    parser.add_argument("--shares", type=float, nargs="+", default=[0.1, 0.3])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    device = "cuda" if cuda else "cpu"
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name() if cuda else 'CPU'}")
    print(
        f"\n### One layer's attention, {HQ} query heads, {HKV} KV heads, head {D}, bf16 "
        f"(median of {args.repeats})\n"
    )
    forced = (
        " | expanded, efficient | math | flex_attention, mask compiled | flex, mask made before"
        if cuda
        else ""
    )
    print(
        "| context | share | queries | attend | 8 chunks (CPU's count) | KV expanded"
        f"{forced} | cold: every position, causal |"
    )
    print("|---|---|---|---|---|---|" + ("---|" * 4 if cuda else "") + "---|")
    if cuda:
        global FLEX_COMPILED_MASK, FLEX_KEPT_MASK
        FLEX_COMPILED_MASK = flex_attend(compile_mask=True)
        FLEX_KEPT_MASK = flex_attend(masks={})
        t0 = time.perf_counter()
        g = torch.Generator().manual_seed(2)
        x = torch.randn(1024, HQ, D, generator=g).to(device, torch.bfloat16)
        kv = x[:, :HKV].contiguous()
        FLEX_KEPT_MASK(
            x[::3].contiguous(), kv, kv, torch.arange(0, 1024, 3, device=device), D**-0.5
        )
        torch.cuda.synchronize()
        print(f"(flex_attention's first call, compiling: {time.perf_counter() - t0:.1f} s)")
    for tokens in args.tokens:
        for share in args.shares:
            print("| " + " | ".join(run(tokens, share, args.repeats, device)) + " |")
    g = torch.Generator().manual_seed(1)
    n = min(args.tokens)
    k = torch.randn(n, HKV, D, generator=g).to(device, torch.bfloat16)
    q = torch.randn(64, HQ, D, generator=g).to(device, torch.bfloat16)
    q_pos = torch.randperm(n, generator=g)[:64].sort().values.to(device)
    print(f"\n### Which SDPA backend takes a masked chunk ({n} keys)\n")
    for backend, verdict in masked_backends(q, k, k, q_pos, D**-0.5).items():
        print(f"- {backend}: {verdict}")


if __name__ == "__main__":
    main()
