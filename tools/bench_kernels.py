"""Kernel benchmarks: correctness check on the device, then one timing table per op family.

    python tools/bench_kernels.py [--only gdn,conv,attn] [--out FILE] [--smoke]

Each family is one ``bench_<family>(args) -> list[str]`` function returning its printed
lines; ``main`` runs the selected ones and prints (and optionally saves) every table.
``--smoke`` runs tiny shapes on CPU under ``TRITON_INTERPRET=1`` with wall-clock timing,
to check the script itself without a GPU.

It imports `triton_ops` from the installed package; where the package is not installed
(a bare GPU machine), put the repository root on the path: `PYTHONPATH=$PWD python ...`.

Timings: ``do_bench`` is Triton's eager timer (it flushes L2 between calls but also
counts host launch gaps when a kernel is shorter than its launch); ``graph`` replays a
CUDA graph that runs the op once per "layer" over enough distinct layers' inputs to
overflow L2 (as a model's consecutive layers do), reported per call.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from triton_ops.gdn_tree import (
    fused_recurrent_gdn_tree,
    gdn_tree_commit,
    gdn_tree_verify,
    naive_recurrent_gdn_tree,
)
from triton_ops.gdn_tree.chunk_triton import verify_triton
from triton_ops.testing import random_tree_metadata, rel_err
from triton_ops.tree_metadata import build_tree_metadata

L2_BYTES = 60 << 20


# --- timing helpers ----------------------------------------------------------------------


def time_eager(fn, device: torch.device) -> float:
    """Median microseconds per call, Triton's do_bench on CUDA, wall clock on CPU."""
    if device.type == "cuda":
        import triton.testing

        return 1e3 * triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    fn()
    start = time.perf_counter()
    fn()
    return 1e6 * (time.perf_counter() - start)


def time_graph(fns: list, device: torch.device, reps: int = 15) -> float:
    """Median microseconds per call of a CUDA graph running ``fns`` (one per layer) in order."""
    if device.type != "cuda":
        return float("nan")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(1e3 * start.elapsed_time(end) / len(fns))
    del graph
    return statistics.median(times)


def guarded(label: str, fn) -> float:
    """Run a timing; a failure is printed and reported as NaN so the other rows still run."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - benchmark tables report failures inline
        print(f"{label}: {type(exc).__name__}: {exc}"[:400], flush=True)
        return float("nan")


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a large device-to-device copy (read + write counted)."""
    if device.type != "cuda":
        return float("nan")
    src = torch.empty(1 << 28, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    us = time_eager(lambda: dst.copy_(src), device)
    return 2 * src.numel() * 4 / (us * 1e-6)


def table(title: str, header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    return [title, line(header), line(["-" * w for w in widths]), *map(line, rows), ""]


def fmt(x: float, digits: int = 1) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


# --- GDN tree verify / commit -------------------------------------------------------------


def gdn_inputs(gen, B, N, H, HV, K, V, dtype, device, num_slots=None):
    """Inputs as the vLLM layer hands them over: pool stored [slots, HV, V, K], transposed view."""
    num_slots = num_slots or B + 3
    q = torch.randn(B, N, H, K, generator=gen).to(device=device, dtype=dtype)
    k = torch.randn(B, N, H, K, generator=gen).to(device=device, dtype=dtype)
    v = torch.randn(B, N, HV, V, generator=gen).to(device=device, dtype=dtype)
    g = (-torch.nn.functional.softplus(torch.randn(B, N, HV, generator=gen) - 1.0)).to(device)
    beta = torch.sigmoid(torch.randn(B, N, HV, generator=gen)).to(device=device, dtype=dtype)
    pool = (0.3 * torch.randn(num_slots, HV, V, K, generator=gen)).to(device).transpose(-1, -2)
    slots = torch.randperm(num_slots, generator=gen)[:B].to(device=device, dtype=torch.int32)
    return q, k, v, g, beta, pool, slots


def gdn_correctness(device, smoke: bool) -> tuple[list[str], bool]:
    """Triton verify/commit and the recurrent baseline against the float64 recurrence."""
    cases = [
        # B, N, H, HV, K, V, tree shape (triton_ops.testing), partial node counts, state dtype
        (3, 40, 2, 4, 16, 32, "bushy", True, torch.float32),
        (2, 64, 1, 3, 64, 64, "chain", False, torch.float32),
        (4, 128, 2, 6, 128, 128, "bushy", True, torch.float32),
        (2, 100, 1, 2, 128, 128, "forest", True, torch.bfloat16),
        (1, 64, 16, 48, 128, 128, "random", False, torch.float32),
        (2, 48, 16, 48, 128, 128, "bushy", True, "bf16 inputs"),
    ]
    if smoke:
        cases = [c for c in cases if c[4] <= 64][:2]
    rows, ok = [], True
    gen = torch.Generator().manual_seed(0)
    for B, N, H, HV, K, V, shape, partial, state_dtype in cases:
        # Partial: the first request full, the others random counts (padding).
        counts = None if partial else [N] * B
        meta = random_tree_metadata(gen, [shape] * B, N, counts, device=device)
        # "bf16 inputs": bf16 q/k/v/beta (the 16-bit dot path), fp32 state.
        low = state_dtype == "bf16 inputs"
        state_dtype = torch.float32 if low else state_dtype
        dtype = torch.bfloat16 if low else torch.float32
        q, k, v, g, beta, pool, slots = gdn_inputs(gen, B, N, H, HV, K, V, dtype, device)
        pool = pool.to(state_dtype)
        ref_o, ref_states = naive_recurrent_gdn_tree(q, k, v, g, beta, pool, slots, meta)
        out = gdn_tree_verify(q, k, v, g, beta, pool, slots, meta)
        pad = ~meta.valid
        pad_ok = all(bool((t[pad] == 0).all()) for t in (out.o, out.delta, out.gate_sum))
        leaf = meta.num_nodes.long() - 1
        new_pool = pool.clone()
        gdn_tree_commit(new_pool, slots, meta, out, leaf)
        want = ref_states[torch.arange(B, device=device), leaf]
        commit_err = rel_err(new_pool[slots.long()], want)
        rec_o, _ = fused_recurrent_gdn_tree(q, k, v, g, beta, pool, slots, meta)
        errs = (rel_err(out.o, ref_o), commit_err, rel_err(rec_o, ref_o))
        # bf16 state or output rounds at ~4e-3; the fp32 commit of bf16 inputs stays tight.
        tol = 1e-4 if state_dtype == torch.float32 and not low else 1e-2
        passed = pad_ok and max(errs) < tol and (not low or commit_err < 1e-4)
        ok &= passed
        rows.append([
            f"{B}x{N}x{H}/{HV}x{K}", shape + ("+pad" if partial else ""),
            "bf16 in" if low else str(state_dtype).split(".")[-1],
            *(f"{e:.1e}" for e in errs), "ok" if passed else "FAIL",
        ])
    header = ["B x N x H/HV x K", "tree", "state", "verify err", "commit err", "recurrent err", "check"]
    return table("GDN tree: fp32 inputs vs float64 per-node recurrence (relative norm error)", header, rows), ok


def gdn_precision_table(device, smoke: bool) -> list[str]:
    """Output error vs float64 at the model's head shape, B = 1, for each dot precision."""
    H, HV, K, V = (2, 4, 16, 16) if smoke else (16, 48, 128, 128)
    rows = []
    gen = torch.Generator().manual_seed(1)
    for N in (16, 64) if smoke else (16, 32, 64, 128):
        meta = random_tree_metadata(gen, ["bushy"], N, device=device)
        for dtype in (torch.float32, torch.bfloat16):
            q, k, v, g, beta, pool, slots = gdn_inputs(gen, 1, N, H, HV, K, V, dtype, device)
            ref_o, _ = naive_recurrent_gdn_tree(q, k, v, g, beta, pool, slots, meta)
            # Each precision is a separate compile per N: the others only where it matters most.
            precisions = ("tf32x3", "tf32", "ieee") if N == 64 and dtype == torch.float32 else ("tf32x3",)
            errs = [
                rel_err(gdn_tree_verify(q, k, v, g, beta, pool, slots, meta, precision=p).o, ref_o)
                for p in precisions
            ]
            rows.append([str(N), str(dtype).split(".")[-1], *(f"{e:.1e}" for e in errs), "-", "-"][:5])
    header = ["N", "inputs", "tf32x3", "tf32", "ieee"]
    return table(f"GDN tree verify: output error vs float64 by dot precision (B=1, H={H}, HV={HV}, "
                 f"K=V={K})", header, rows)


def gdn_fla_chain(device, N: int, B: int, H: int, HV: int, K: int, V: int, layers: int):
    """fla's chunk kernel on a chain of N tokens: (eager us, graph us, bf16 err, our bf16 err)."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    gen = torch.Generator().manual_seed(2)
    sets = [gdn_inputs(gen, B, N, H, HV, K, V, torch.bfloat16, device) for _ in range(layers)]
    # fla takes the states gathered and [B, HV, K, V]-contiguous: gather outside the timing.
    states = [s[5][s[6].long()].contiguous() for s in sets]

    def call(i):
        q, k, v, g, beta = sets[i][:5]
        return chunk_gated_delta_rule(
            q, k, v, g, beta, initial_state=states[i], output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )

    eager = time_eager(lambda: call(0), device)
    graph = time_graph([lambda i=i: call(i) for i in range(layers)], device)
    err = ours = float("nan")
    if B == 1:
        q, k, v, g, beta, pool, slots = sets[0]
        meta = build_tree_metadata(torch.arange(-1, N - 1, device=device).view(1, N))
        ref_o, _ = naive_recurrent_gdn_tree(q, k, v, g, beta, pool, slots, meta)
        err = rel_err(call(0)[0], ref_o)
        ours = rel_err(gdn_tree_verify(q, k, v, g, beta, pool, slots, meta).o, ref_o)
    return eager, graph, err, ours


def gdn_timing_table(device, args, bandwidth: float, deadline: float) -> list[str]:
    smoke = args.smoke
    H, HV, K, V = (2, 4, 16, 16) if smoke else (16, 48, 128, 128)
    Ns = (16,) if smoke else (16, 32, 64, 128)
    Bs = (1, 2) if smoke else (1, 8, 32)
    rows, fla_rows = [], []
    gen = torch.Generator().manual_seed(3)
    for N in Ns:
        for B in Bs:
            if time.monotonic() > deadline:
                rows.append([str(N), str(B), "(out of time)"] + [""] * 8)
                continue
            state_bytes = B * HV * K * V * 4
            in_bytes = B * N * (2 * H * K * 2 + HV * V * 2 + HV * (4 + 2))
            out_bytes = B * N * (HV * V * (2 + 4) + HV * 8 + H * K * 4)
            layers = max(1, min(16, math.ceil(2 * L2_BYTES / (state_bytes + in_bytes + out_bytes))))
            meta = random_tree_metadata(gen, ["bushy"] * B, N, [N] * B, device=device)
            sets = [gdn_inputs(gen, B, N, H, HV, K, V, torch.bfloat16, device) for _ in range(layers)]
            outs = [gdn_tree_verify(*s, meta) for s in sets]
            leaf = torch.full((B,), N - 1, device=device)
            depth = int(meta.depths[0, N - 1]) + 1
            verify_eager = guarded("verify eager", lambda: time_eager(lambda: gdn_tree_verify(*sets[0], meta), device))
            verify_graph = guarded("verify graph", lambda: time_graph(
                [lambda s=s: gdn_tree_verify(*s, meta) for s in sets], device))
            commit_graph = guarded("commit graph", lambda: time_graph(
                [lambda s=s, o=o: gdn_tree_commit(s[5], s[6], meta, o, leaf) for s, o in zip(sets, outs)],
                device,
            ))
            rec_graph = float("nan")
            if not args.skip_baselines:
                node_states = torch.empty(B, N, HV, K, V, dtype=torch.float32, device=device)
                rec_graph = guarded("recurrent graph", lambda: time_graph(
                    [lambda s=s: fused_recurrent_gdn_tree(*s, meta, node_states=node_states) for s in sets],
                    device,
                ))
                del node_states
            verify_floor = 1e6 * (state_bytes + in_bytes + out_bytes) / bandwidth
            commit_bytes = 2 * state_bytes + B * depth * (H * K * 4 + HV * V * 4 + HV * 8)
            commit_floor = 1e6 * commit_bytes / bandwidth
            rows.append([
                str(N), str(B), str(layers), fmt(verify_eager), fmt(verify_graph), fmt(verify_floor),
                fmt(commit_graph), fmt(commit_floor), fmt(rec_graph),
                fmt(rec_graph / verify_graph if verify_graph else float("nan")),
            ])
            if device.type == "cuda" and time.monotonic() < deadline and not args.skip_baselines:
                try:
                    fla = gdn_fla_chain(device, N, B, H, HV, K, V, layers)
                except Exception as exc:  # noqa: BLE001 - fla is a baseline, not under test
                    print(f"fla chunk N={N} B={B}: {type(exc).__name__}: {exc}"[:400], flush=True)
                    fla = None
                if fla is not None:
                    eager, graph, err, ours = fla
                    fla_rows.append([str(N), str(B), fmt(eager), fmt(graph), fmt(verify_graph),
                                     "-" if math.isnan(err) else f"{err:.1e}",
                                     "-" if math.isnan(ours) else f"{ours:.1e}"])
            del sets, outs
            if device.type == "cuda":
                torch.cuda.empty_cache()
    header = ["N", "B", "layers", "verify eager", "verify graph", "verify floor", "commit graph",
              "commit floor", "recurrent graph", "recurrent/verify"]
    lines = table(
        f"GDN tree (us per layer; H={H}, HV={HV}, K=V={K}, bf16 q/k/v, fp32 state in vLLM's "
        f"[slots, HV, V, K] layout, random draft trees; floor = bytes / {fmt(bandwidth / 1e12, 2)} TB/s)",
        header, rows,
    )
    if fla_rows:
        lines += table(
            "fla 0.6.0 chunk_gated_delta_rule on a chain of N (us; bf16 output error vs float64, "
            "ours on the same chain)",
            ["N", "B", "fla eager", "fla graph", "ours graph (tree)", "fla bf16 err", "ours bf16 err"],
            fla_rows,
        )
    return lines


def gdn_config_sweep(device, smoke: bool, deadline: float) -> list[str]:
    """Verify kernel time per launch configuration (CUDA graph), at N = 64."""
    if device.type != "cuda":
        return []
    H, HV, K, V = 16, 48, 128, 128
    rows = []
    gen = torch.Generator().manual_seed(4)
    configs = [(bv, w, "tf32x3") for bv in (32, 64, 128) for w in (4, 8)]
    configs += [(32, 4, "tf32"), (32, 4, "ieee")]
    for N, B in ((64, 1), (64, 8), (64, 32)):
        meta = random_tree_metadata(gen, ["bushy"] * B, N, [N] * B, device=device)
        sets = [gdn_inputs(gen, B, N, H, HV, K, V, torch.bfloat16, device) for _ in range(8 if B == 1 else 2)]
        for bv, warps, prec in configs:
            if time.monotonic() > deadline:
                break

            def call(s, bv=bv, warps=warps, prec=prec):
                q, k, v, g, beta, pool, slots = s
                return verify_triton(q, k, v, g, beta, pool, slots, meta, K**-0.5, True, prec,
                                     block_v=bv, num_warps=warps)

            try:
                us = time_graph([lambda s=s: call(s) for s in sets], device)
            except Exception as exc:  # a configuration that does not compile is reported, not fatal
                us = float("nan")
                print(f"config BV={bv} warps={warps} {prec}: {type(exc).__name__}: {exc}"[:300])
            rows.append([str(N), str(B), str(bv), str(warps), prec, fmt(us)])
    return table("GDN tree verify launch configurations (us per layer, CUDA graph)",
                 ["N", "B", "BV", "warps", "precision", "graph"], rows)


def bench_gdn(args) -> list[str]:
    device = torch.device("cpu" if args.smoke else "cuda")
    deadline = time.monotonic() + args.budget_s
    lines, ok = gdn_correctness(device, args.smoke)
    print("\n".join(lines), flush=True)
    bandwidth = copy_bandwidth(device)
    timing = gdn_timing_table(device, args, bandwidth, deadline)
    print("\n".join(timing), flush=True)
    precision = gdn_precision_table(device, args.smoke)
    print("\n".join(precision), flush=True)
    sweep = gdn_config_sweep(device, args.smoke, deadline)
    print("\n".join(sweep), flush=True)
    if not ok:
        args.failed.append("gdn")
    return lines + timing + precision + sweep


def bench_conv(args) -> list[str]:
    """Tree conv1d and its commit (tables printed by tools/bench_tree_ops.py)."""
    import bench_tree_ops

    bench_tree_ops.check_conv()
    bench_tree_ops.bench_conv(bench_tree_ops.copy_bandwidth())
    return []


def bench_attention(args) -> list[str]:
    """Tree attention and the KV commit (tables printed by tools/bench_tree_ops.py)."""
    import bench_tree_ops

    bandwidth = bench_tree_ops.copy_bandwidth()
    bench_tree_ops.check_attention()
    bench_tree_ops.bench_kv_commit(bandwidth)
    bench_tree_ops.bench_attention(bandwidth, bench_tree_ops.matmul_rate(),
                                   with_sdpa=not args.skip_baselines)
    return []


FAMILIES = {"gdn": bench_gdn, "conv": bench_conv, "attn": bench_attention}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=",".join(FAMILIES), help=f"comma list of {sorted(FAMILIES)}")
    parser.add_argument("--out", type=Path, help="also write the tables to this file")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (TRITON_INTERPRET=1)")
    parser.add_argument("--skip-baselines", action="store_true", help="skip the baselines (GDN: recurrent and fla rows; attention: SDPA)")
    parser.add_argument("--budget-s", type=float, default=360.0, help="stop starting new timings after this")
    args = parser.parse_args()
    only = [name for name in args.only.split(",") if name]
    unknown = sorted(set(only) - set(FAMILIES))
    if unknown:
        parser.error(f"--only: unknown families {unknown}; choose from {sorted(FAMILIES)}")
    if args.smoke and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("--smoke runs the kernels interpreted: set TRITON_INTERPRET=1")
    if not args.smoke and not torch.cuda.is_available():
        parser.error("no CUDA device: run on a GPU, or pass --smoke")
    args.failed = []
    args.started = time.monotonic()
    lines = []
    if not args.smoke:
        import triton

        lines.append(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
        print(lines[-1], flush=True)
    for name in only:
        lines += FAMILIES[name](args)
    lines.append(f"total {time.monotonic() - args.started:.0f} s")
    print(lines[-1])
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")
    if args.failed:
        print(f"CORRECTNESS FAILED: {args.failed}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
