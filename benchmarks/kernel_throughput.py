"""Throughput of the fused KV move: gather staged donor rows, RoPE-correct K, scatter into the
paged cache of every layer (``semshare_vllm.kernels.gather_rearrange``).

* CPU: the torch reference on a SmolLM2-135M-shaped cache (30 layers, 3 KV heads, head 64,
  block 16), fp32 and bf16, CPU_ATTN "vec" pages and packed pages, 2K and 8K tokens; then a
  whole semantic load, donor pages to target pages, staged and scattered by that reference (the
  CUDA path) against ``page_move`` (the CPU path).
* CUDA (only when available): the Triton kernel on a Qwen2.5-7B-shaped cache (28 layers,
  4 KV heads, head 128, bf16, packed pages), 8K and 32K tokens, with the share of the device's
  peak bandwidth and a check against the torch reference; then in a block-outer layout (the
  layers interleave inside each block), one launch for all layers against one per layer.

GB/s counts bytes read from the staging tensor plus bytes written to the cache (index, position
and angle-table traffic left out); the time is the median of ``--repeats`` runs after a warm-up.
Source rows are shuffled (donor tokens land at other positions); target blocks are shuffled too.

    python benchmarks/kernel_throughput.py [--repeats 5] [--peak-gbps 3350]
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from semshare_vllm.kernels import RopeTable, gather_rearrange, stage_rows, triton_gather
from semshare_vllm.kernels.page_move import move_aligned_rows
from semshare_vllm.layout.paged_cache import per_layer_stacks, slots_for
from semshare_vllm.layout.specs import PageOffsets, PageSpec, page_spec
from semshare_vllm.testbed import rope_tables
from semshare_vllm.testbed.timing import median_ms


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    kv_heads: int
    head_size: int
    rope_table: str  # the name of its angle table in testbed.rope_tables
    block_size: int = 16


SMOLLM2_135M = ModelShape("SmolLM2-135M", 30, 3, 64, "smollm2")
QWEN25_7B = ModelShape("Qwen2.5-7B", 28, 4, 128, "qwen25_7b")


@dataclass
class Case:
    src: torch.Tensor  # [L, T, H, 2D] staging
    rows: torch.Tensor
    slots: torch.Tensor
    src_pos: torch.Tensor
    dst_pos: torch.Tensor
    caches: list[torch.Tensor]
    offsets: PageOffsets
    table: RopeTable

    @property
    def bytes_moved(self) -> int:
        per_token = self.src[0, 0].numel() * self.src.shape[0]
        return (
            self.rows.numel()
            * per_token
            * (self.src.element_size() + self.caches[0].element_size())
        )

    def move(self, impl: str, caches: list[torch.Tensor] | None = None) -> None:
        gather_rearrange(
            self.src,
            self.rows,
            self.slots,
            caches or self.caches,
            self.offsets,
            self.table,
            self.src_pos,
            self.dst_pos,
            impl=impl,
        )


def rope_table(shape: ModelShape, max_position: int) -> RopeTable:
    """vLLM's table for the shape (saved ones where ``$SEMSHARE_TEST_ROPE_TABLES`` names a file:
    see ``semshare_vllm.testbed.rope_tables``, for a GPU machine without vLLM)."""
    table = rope_tables.tables([shape.rope_table])[shape.rope_table]
    if table.max_position < max_position:
        raise SystemExit(
            f"{shape.name}: rope table has {table.max_position} positions, {max_position} needed"
        )
    return table


def build_case(
    shape: ModelShape,
    tokens: int,
    dtype: torch.dtype,
    layout: PageSpec,
    table: RopeTable,
    device: str,
    seed: int = 0,
    block_outer: bool = False,
) -> Case:
    """``block_outer``: vLLM 0.33's block-outer layouts (here BLHNC), every layer's pages of a
    block side by side, so the layers interleave in the one buffer."""
    g = torch.Generator().manual_seed(seed)
    bs = shape.block_size
    num_blocks = -(-tokens // bs) + 1
    outer = (num_blocks, shape.layers) if block_outer else (shape.layers, num_blocks)
    buffer = torch.zeros(
        *outer,
        shape.kv_heads,
        bs,
        2 * shape.head_size,
        dtype=dtype,
        device=device,
    )  # one allocation, like vLLM's
    torch.manual_seed(seed)
    src = torch.randn(
        shape.layers, tokens, shape.kv_heads, 2 * shape.head_size, device=device, dtype=dtype
    )
    rows = torch.randperm(tokens, generator=g)
    blocks = torch.randperm(num_blocks, generator=g)
    pos = torch.arange(tokens)
    slots = blocks[pos // bs] * bs + pos % bs
    src_pos = (rows + 7) % table.max_position  # the donor had these tokens elsewhere
    caches = list(buffer.transpose(0, 1) if block_outer else buffer)
    return Case(
        src,
        rows.to(device),
        slots.to(device),
        src_pos.to(device),
        pos.to(device),
        caches,
        layout.offsets(caches[0]).to(device),
        table.to(device),
    )


def median_seconds(fn, repeats: int, device: str) -> float:
    return median_ms(fn, repeats, device) / 1e3


def print_table(headers: list[str], rows: list[list]) -> None:
    print("| " + " | ".join(headers) + " |")
    print("|" + "|".join("---" for _ in headers) + "|")
    for row in rows:
        print("| " + " | ".join(str(x) for x in row) + " |")
    print()


def cpu_row(
    shape: ModelShape,
    tokens: int,
    dtype: torch.dtype,
    layout: PageSpec,
    table: RopeTable,
    repeats: int,
) -> list:
    case = build_case(shape, tokens, dtype, layout, table, "cpu")
    seconds = median_seconds(partial(case.move, "torch"), repeats, "cpu")
    return [
        layout.backend,
        str(dtype).removeprefix("torch."),
        tokens,
        f"{case.bytes_moved / 2**20:.0f}",
        f"{seconds * 1e3:.1f}",
        f"{case.bytes_moved / seconds / 1e9:.2f}",
    ]


def cpu_load_row(
    shape: ModelShape,
    tokens: int,
    dtype: torch.dtype,
    layout: PageSpec,
    table: RopeTable,
    alignment: str,
    repeats: int,
) -> list:
    """A whole semantic load, donor pages to target pages, both ways: staged rows scattered by
    the fused kernel's torch reference (the CUDA path run here) and ``page_move`` (the CPU
    path). ``alignment``: "run" (every target token takes the donor token 37 positions on: the
    same text at another offset) or "shuffled" (each takes a random donor row)."""
    g = torch.Generator().manual_seed(1)
    bs = shape.block_size
    num_blocks = -(-tokens // bs) + 2
    pages = (shape.layers, num_blocks, shape.kv_heads, bs, 2 * shape.head_size)
    donor = torch.randn(pages, generator=g).to(dtype)
    target = torch.zeros(pages, dtype=dtype)
    donor_blocks = torch.randperm(num_blocks, generator=g).tolist()
    target_blocks = torch.randperm(num_blocks, generator=g).tolist()
    if alignment == "run":
        donor_pos = np.arange(tokens) + 37
        donor_pos[donor_pos >= tokens] = -1
    else:
        donor_pos = torch.randperm(tokens, generator=g).numpy()
    aligned = np.flatnonzero(donor_pos >= 0)
    rows = torch.as_tensor(donor_pos[aligned])
    offsets = layout.offsets(donor[0])

    def staged_kernel():
        staged = stage_rows(donor, slots_for(donor_blocks, 0, tokens, bs)[rows], offsets)
        gather_rearrange(
            staged,
            torch.arange(len(rows)),
            slots_for(target_blocks, 0, tokens, bs)[torch.as_tensor(aligned)],
            list(target),
            offsets,
            table,
            rows,
            torch.as_tensor(aligned),
            impl="torch",
        )

    def by_pages():
        move_aligned_rows(layout, donor, donor_blocks, target, target_blocks, 0, donor_pos, table)

    moved = len(rows) * shape.layers * shape.kv_heads * 2 * shape.head_size
    moved_bytes = 2 * moved * donor.element_size()  # read once, written once
    out = [layout.backend, str(dtype).removeprefix("torch."), tokens, alignment]
    for fn in (staged_kernel, by_pages):
        seconds = median_seconds(fn, repeats, "cpu")
        out += [f"{seconds * 1e3:.1f}", f"{moved_bytes / seconds / 1e9:.2f}"]
    return out


def cpu_suite(args) -> None:
    shape = SMOLLM2_135M
    table = rope_table(shape, max(args.cpu_tokens) + 64)
    layouts = [
        page_spec("CPU_ATTN", shape.head_size, "vec"),
        page_spec("FLASH_ATTN", shape.head_size),
    ]
    rows = [
        cpu_row(shape, tokens, dtype, layout, table, args.repeats)
        for layout in layouts
        for dtype in (torch.float32, torch.bfloat16)
        for tokens in args.cpu_tokens
    ]
    print(
        f"### CPU torch reference, {shape.name} cache ({shape.layers} layers, "
        f"{shape.kv_heads} KV heads, head {shape.head_size}, block {shape.block_size}), "
        f"{torch.get_num_threads()} threads\n"
    )
    print_table(["layout", "dtype", "tokens", "MiB moved", "ms (median)", "GB/s"], rows)
    loads = [
        cpu_load_row(shape, tokens, dtype, layout, table, alignment, args.repeats)
        for layout in layouts
        for dtype in (torch.float32, torch.bfloat16)
        for tokens in args.cpu_tokens
        for alignment in ("run", "shuffled")
    ]
    print("### A whole semantic load on CPU, donor pages to target pages\n")
    print_table(
        [
            "layout",
            "dtype",
            "tokens",
            "alignment",
            "staged + kernel ms",
            "GB/s",
            "page_move ms",
            "GB/s",
        ],
        loads,
    )


def gpu_row(
    shape: ModelShape,
    tokens: int,
    layout: PageSpec,
    table: RopeTable,
    args,
    device: str,
    offset_tables: bool = False,
    block_outer: bool = False,
    per_layer: bool = False,
) -> list:
    """``per_layer``: one launch per layer, as before layer stacks spanned interleaved layers."""
    case = build_case(shape, tokens, torch.bfloat16, layout, table, device, block_outer=block_outer)
    if offset_tables:  # the packed pages addressed through the generic [N, D] tables
        case.offsets = dataclasses.replace(case.offsets, token_stride=None, channel_stride=None)
    stack = triton_gather.stack_layers
    if per_layer:
        triton_gather.stack_layers = per_layer_stacks
    try:
        seconds = median_seconds(partial(case.move, "triton"), args.repeats, device)
    finally:
        triton_gather.stack_layers = stack
    want = build_case(  # zeros in the same layout
        shape, tokens, torch.bfloat16, layout, table, device, block_outer=block_outer
    ).caches
    case.move("torch", want)
    exact = all(torch.equal(w, c) for w, c in zip(want, case.caches))
    worst = max((w.float() - c.float()).abs().max().item() for w, c in zip(want, case.caches))
    gbps = case.bytes_moved / seconds / 1e9
    return [
        ("one launch per layer" if per_layer else "one launch")
        if block_outer
        else ("tables" if offset_tables else "computed"),
        tokens,
        f"{case.bytes_moved / 2**20:.0f}",
        f"{seconds * 1e3:.3f}",
        f"{gbps:.0f}",
        f"{100 * gbps / args.peak_gbps:.1f}%",
        "bit-exact" if exact else f"max abs diff {worst:.3g}",
    ]


def gpu_suite(args, device: str = "cuda") -> None:
    """(``device`` other than cuda only to dry-run this code under TRITON_INTERPRET=1.)"""
    shape = QWEN25_7B
    table = rope_table(shape, max(args.gpu_tokens) + 64)
    layout = page_spec("FLASH_ATTN", shape.head_size)
    rows = []
    for tokens in args.gpu_tokens:
        for offset_tables in (False, True):
            rows.append(gpu_row(shape, tokens, layout, table, args, device, offset_tables))
            if device == "cuda":
                torch.cuda.empty_cache()
    name = torch.cuda.get_device_name() if device == "cuda" else device
    print(
        f"### Triton kernel, {shape.name} cache ({shape.layers} layers, {shape.kv_heads} "
        f"KV heads, head {shape.head_size}, bf16, packed), {name}, "
        f"peak {args.peak_gbps:.0f} GB/s\n"
    )
    headers = ["tokens", "MiB moved", "ms (median)", "GB/s", "% of peak", "vs reference"]
    print_table(["page offsets", *headers], rows)
    rows = []
    for tokens in args.gpu_tokens:
        for per_layer in (False, True):
            rows.append(
                gpu_row(
                    shape,
                    tokens,
                    layout,
                    table,
                    args,
                    device,
                    block_outer=True,
                    per_layer=per_layer,
                )
            )
            if device == "cuda":
                torch.cuda.empty_cache()
    print("\n### The same, block-outer layout (BLHNC: the layers interleave inside each block)\n")
    print_table(["launches", *headers], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--peak-gbps",
        type=float,
        default=3350.0,
        help="device peak memory bandwidth (default: H100 SXM)",
    )
    parser.add_argument("--cpu-tokens", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--gpu-tokens", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--skip-cpu", action="store_true")
    args = parser.parse_args()
    if not args.skip_cpu:
        cpu_suite(args)
    if torch.cuda.is_available():
        gpu_suite(args)
    else:
        print("(no CUDA device: Triton kernel not timed)")


if __name__ == "__main__":
    main()
