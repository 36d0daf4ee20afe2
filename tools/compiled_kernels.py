"""What ptxas makes of the GDN tree verify for sm_90 (the H100 / H200), on a machine without
a GPU: registers, spill stack, SASS instructions, local loads and stores per launch, and
optionally the source lines holding the most instructions.

    TRITON_INTERPRET=1 python tools/compiled_kernels.py --shapes 65x1,17x8 --configs default,32x8 \
        [--kernel peeled_tile] [--prepare-warps 8] [--k-chunk 32] [--compiler device|local] \
        [--lines 20] [--out FILE]

Shapes are N x B (nodes x requests) at Qwen3.6-27B's GDN (H = 16, HV = 48, K = V = 128), bf16
q/k/v and an fp32 state in vLLM's layout, bushy trees, every node real; each op is called as
the engine calls it on CUDA, its launches recorded (not run) and compiled
(``triton_ops.testing.compile_sm90``). Configs are BV x warps (``default``: the dispatch's).
``--compiler device`` (the default) compiles with the device image's Triton, which
tools/setup_env.sh installs beside the venv; ``local`` with this machine's.

Not timings, and counted in the code, where a loop's body counts once: the instructions are
the code's size, the stack and local loads its spills, and each wgmma wait a dot every warp
stops for (its operands staged through shared memory behind a barrier first).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from triton_ops.gdn_tree.chunk import DEFAULT_PRECISION
from triton_ops.gdn_tree.chunk_triton import VERIFY_KERNELS, default_verify_kernel, kernel_takes_warps, verify_triton
from triton_ops.testing import compile_sm90, device_triton, random_tree_metadata, recording_launches

H, HV, K = 16, 48, 128


def verify_launches(N: int, B: int, kernel: str, block_v: int | None, num_warps: int | None,
                    prepare_warps: int | None = None, k_chunk: int | None = None) -> list:
    """The launches of one verify call at N x B, recorded as CUDA would run them."""
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(B, N, H, K, generator=gen).bfloat16() for _ in range(2))
    v = torch.randn(B, N, HV, K, generator=gen).bfloat16()
    g = -torch.rand(B, N, HV, generator=gen)
    beta = torch.rand(B, N, HV, generator=gen)
    state = torch.randn(B + 1, HV, K, K, generator=gen).transpose(-1, -2)  # vLLM's [slots, HV, V, K]
    meta = random_tree_metadata(gen, ["bushy"] * B, N, [N] * B)
    with recording_launches() as launches:
        verify_triton(q, k, v, g, beta, state, torch.arange(B), meta, K ** -0.5, True,
                      DEFAULT_PRECISION, kernel=kernel, block_v=block_v, num_warps=num_warps,
                      prepare_warps=prepare_warps, k_chunk=k_chunk)
    return launches


def source_line(where: str) -> str:
    """The text of ``path:line`` (relative to the repository), or "" (``?``: no line)."""
    path, _, line = where.rpartition(":")
    file = Path(__file__).resolve().parent.parent / path
    return file.read_text().splitlines()[int(line) - 1].strip()[:80] if path and file.is_file() else ""


def parse_pairs(text: str, what: str) -> list[tuple[int, int]]:
    pairs = [item.split("x") for item in text.split(",")]
    if not all(len(pair) == 2 and all(x.isdigit() for x in pair) for pair in pairs):
        raise argparse.ArgumentTypeError(f"{what} must be comma-separated AxB pairs, got {text!r}")
    return [(int(a), int(b)) for a, b in pairs]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="65x1", type=lambda t: parse_pairs(t, "--shapes"),
                        help="N x B pairs (default 65x1, the engine's budget-64 tree at batch 1)")
    parser.add_argument("--configs", default="default",
                        help="BV x warps pairs, or default (the dispatch's), comma-separated")
    parser.add_argument("--kernel", choices=VERIFY_KERNELS, default=None,
                        help="verify kernel (default: the dispatch's for each shape)")
    parser.add_argument("--prepare-warps", type=int, default=None, help="warps of a split's first kernel")
    parser.add_argument("--k-chunk", type=int, default=None, help="key columns a pass over K takes (verify_triton's k_chunk)")
    parser.add_argument("--compiler", choices=("device", "local"), default="device")
    parser.add_argument("--lines", type=int, default=0, help="source lines with most instructions to list")
    parser.add_argument("--out", type=Path, default=None, help="also append the table to this file")
    args = parser.parse_args(argv)
    try:
        configs = [None if item == "default" else parse_pairs(item, "--configs")[0]
                   for item in args.configs.split(",")]
    except argparse.ArgumentTypeError as error:
        parser.error(str(error))
    root = device_triton() if args.compiler == "device" else None

    rows, details = [], []
    for N, B in args.shapes:
        kernel = args.kernel or default_verify_kernel(N, B * HV)
        for config in configs:
            block_v, num_warps = config or (None, None)
            if num_warps and not kernel_takes_warps(kernel, num_warps):
                details.append(f"\n{kernel} at {N} x {B} takes no {num_warps} warps (PEELED_MAX_WARPS): not compiled")
                continue
            launches = verify_launches(N, B, kernel, block_v, num_warps, args.prepare_warps, args.k_chunk)
            for launch, report in zip(launches, compile_sm90(launches, root, args.lines)):
                options = launch[2]
                shape = f"{options.get('BV', '-')} x {options.get('num_warps', '-')}"
                rows.append(f"| {N} | {B} | {kernel} | {report['kernel']} | {shape} | {report['registers']} "
                            f"| {report['stack']} | {report['instructions']:,} | {report['local_loads']} "
                            f"| {report['local_stores']} | {report['barriers']} | {report['mma_waits']} |")
                if report["lines"]:
                    details += [f"\n{report['kernel']} at {N} x {B}, BV x warps {shape}:"]
                    details += [f"  {count:6d}  {where:44s} {source_line(where)}"
                                for where, count in report["lines"]]
    lines = [f"GDN tree verify compiled for sm_90 by the {args.compiler} Triton "
             f"(H = {H}, HV = {HV}, K = V = {K}, bf16 inputs, fp32 state)", "",
             "| N | B | kernel | launch | BV x warps | registers | stack B | instructions | LDL | STL "
             "| barriers | wgmma waits |",
             "|--:|--:|---|---|---|--:|--:|--:|--:|--:|--:|--:|", *rows, *details]
    print("\n".join(lines))
    if args.out is not None:
        with args.out.open("a") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
