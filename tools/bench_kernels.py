"""Kernel benchmarks, one tool for every tree-op family: correctness on the device first,
then one timing table per family.

    python tools/bench_kernels.py [--only gdn,conv,attn,verify,gemm] [--out FILE] [--sweep] [--smoke]
    ncu --clock-control none -k regex:"_verify|_commit" python tools/bench_kernels.py --profile-gdn
    ncu --clock-control none -k regex:_tree_attention python tools/bench_kernels.py --profile-attn

(ncu writes its report when the program exits: a run cut by a timeout leaves none, so bound
it with ncu's ``-c COUNT`` rather than a timeout.)

Families: ``gdn`` (tree verify / commit against the per-node-state baseline, fla's chunk
kernel on a chain of the same N and vLLM's own GDN spec-decode kernel at the same token
count, where importable), ``conv`` (tree conv1d and its commit), ``attn`` (tree attention
against SDPA, and the tree KV commit), ``verify`` (the sampled verifiers, traversal and
target-only, with their per-node sweeps as the PyTorch path and as triton_ops.traversal's
kernels, eager: model runner V2 verifies outside its graphs), ``gemm`` (Qwen3.6-27B's linear
layers, cuBLAS through F.linear, by token count: the dense part of a tree forward). Each family is one ``bench_<family>(args)`` function
that checks, times and returns its printed lines; ``main`` runs the selected ones and prints
(and with ``--out`` saves) every table. ``--sweep`` adds the launch-configuration sweeps.
``--smoke`` runs tiny shapes on CPU under ``TRITON_INTERPRET=1`` with wall-clock timing, to
check the script itself without a GPU.

It imports `triton_ops` from the installed package; where the package is not installed
(a bare GPU machine), put the repository root on the path: `PYTHONPATH=$PWD python ...`.

Timings, median microseconds: ``eager`` is Triton's ``do_bench`` (it flushes L2 between
calls but also counts host launch gaps when a kernel is shorter than its launch);
``graph`` replays a CUDA graph that runs the op once per "layer" over enough distinct
layers' inputs to overflow L2 (as a model's consecutive layers do), reported per call.
Floors: bytes moved once / measured copy bandwidth; FLOPs / measured bf16 matmul rate.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import NamedTuple

import dataclasses

import torch

from triton_ops.gdn_tree import (
    fused_recurrent_gdn_tree,
    gdn_tree_commit,
    gdn_tree_commit_layers,
    gdn_tree_verify,
    naive_recurrent_gdn_tree,
)
from triton_ops.gdn_tree.chunk import DEFAULT_PRECISION, PRECISIONS, commit_layer_table
from triton_ops.gdn_tree.chunk_triton import (
    FUSE_STATE_PARTS,
    VERIFY_KERNELS,
    commit_triton,
    default_verify_kernel,
    fuses_parts,
    kernel_takes,
    kernel_takes_warps,
    key_chunk,
    verify_triton,
)
from triton_ops.testing import compiled_variants, random_tree_metadata, rel_err, same_bits
from triton_ops.tree_attention import (
    naive_tree_attention,
    naive_tree_kv_commit,
    paged_tree_attention,
    tree_kv_commit,
)
from triton_ops.tree_attention.attention import kernel_config
from triton_ops.tree_metadata import TreeMetadata, build_tree_metadata
from vllm_tfm.benchmarks.gpu_clocks import ClockSampler
from vllm_tfm.benchmarks.launches import launches
from vllm_tfm.drafting.builders import build_sampled_tree
from vllm_tfm.drafting.tree import DraftTree
from vllm_tfm.drafting.verifiers import (
    traversal_plan,
    verify_greedy,
    verify_target_only,
    verify_traversal,
    walk_plan,
)

L2_BYTES = 60 << 20
# Qwen3.6-27B's GDN layers: what one commit launch serves in the engine.
MODEL_GDN_LAYERS = 48


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


# Ops timed on one input set run this many times per graph: one replay costs ~15 us of
# launch on the H200, more than a small op itself.
GRAPH_REPEATS = 16


def layers_for(bytes_per_layer: int) -> int:
    """Distinct layers' inputs a graph cycles through so that they overflow L2 twice."""
    return max(1, min(16, math.ceil(2 * L2_BYTES / max(bytes_per_layer, 1))))


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


def matmul_rate(device: torch.device) -> float:
    """FLOP per second of a large bf16 matrix product on random data."""
    if device.type != "cuda":
        return float("nan")
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    return 2 * 8192**3 / (time_eager(lambda: a @ a, device) * 1e-6)


def table(title: str, header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(header)]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    return [title, line(header), line(["-" * w for w in widths]), *map(line, rows), ""]


def fmt(x: float, digits: int = 1) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def fmt_err(x: float) -> str:
    return "-" if x is None or math.isnan(x) else f"{x:.1e}"


def sm_clock(clocks: ClockSampler) -> str:
    return fmt(clocks.summary["sm_mhz"], 0) if clocks.summary else "-"


def meta_on(meta: TreeMetadata, device) -> TreeMetadata:
    return type(meta)(**{k: v.to(device) for k, v in vars(meta).items()})


def check_row(rows: list, failed: list, name: str, err: float, tol: float) -> None:
    """One correctness row; NaN and inf never pass."""
    ok = math.isfinite(err) and err <= tol
    if not ok:
        failed.append(name)
    rows.append([name, fmt_err(err), f"{tol:.0e}", "ok" if ok else "FAIL"])


# --- GDN tree verify / commit -------------------------------------------------------------


def gdn_inputs(gen, B, N, H, HV, K, V, dtype, device, num_slots=None):
    """Inputs as the tree path hands them over: q / k / v views of the tree conv's output
    (q | k | v columns, vllm_glue.gdn.split_qkv), the pool stored [slots, HV, V, K] and
    seen transposed."""
    num_slots = num_slots or B + 3
    fused = torch.randn(B, N, 2 * H * K + HV * V, generator=gen).to(device=device, dtype=dtype)
    q, k, v = fused.split([H * K, H * K, HV * V], dim=-1)
    q, k, v = q.unflatten(-1, (H, K)), k.unflatten(-1, (H, K)), v.unflatten(-1, (HV, V))
    g = (-torch.nn.functional.softplus(torch.randn(B, N, HV, generator=gen) - 1.0)).to(device)
    beta = torch.sigmoid(torch.randn(B, N, HV, generator=gen)).to(device=device, dtype=dtype)
    pool = (0.3 * torch.randn(num_slots, HV, V, K, generator=gen)).to(device).transpose(-1, -2)
    slots = torch.randperm(num_slots, generator=gen)[:B].to(device=device, dtype=torch.int32)
    return q, k, v, g, beta, pool, slots


def gdn_errors(inputs, meta, precision: str = "tf32x3", first: int | None = None, kernel: str | None = None):
    """(verify output error, committed state error, the float64 outputs) against the
    float64 recurrence, on the first ``first`` requests (the reference keeps every
    node's state in float64); ``kernel``: a verify kernel other than the default. The
    commit error is infinite where gdn_tree_commit_layers over two layers does not give
    each layer gdn_tree_commit's state bit for bit."""
    q, k, v, g, beta, pool, slots = inputs
    B = q.shape[0] if first is None else min(first, q.shape[0])
    sub = type(meta)(**{name: t[:B] for name, t in vars(meta).items()})
    q, k, v, g, beta, slots = q[:B], k[:B], v[:B], g[:B], beta[:B], slots[:B]
    ref_o, ref_states = naive_recurrent_gdn_tree(q, k, v, g, beta, pool, slots, sub)
    if kernel is None:
        out = gdn_tree_verify(q, k, v, g, beta, pool, slots, sub, precision=precision)
    else:
        out = verify_triton(q, k, v, g, beta, pool, slots, sub, q.shape[-1] ** -0.5, True, precision,
                            kernel=kernel)
    leaf = sub.num_nodes.long() - 1
    new_pool = pool.clone()
    gdn_tree_commit(new_pool, slots, sub, out, leaf, precision=precision)
    want = ref_states[torch.arange(B, device=q.device), leaf]
    commit_err = rel_err(new_pool[slots.long()], want)
    # The engine's one launch for several layers must commit each as its own launch does.
    layers = [pool.clone(), pool.clone()]
    gdn_tree_commit_layers(layers, [slots] * 2, sub, [out] * 2, leaf, precision=precision)
    if not all(same_bits(layer, new_pool) for layer in layers):
        commit_err = math.inf
    return rel_err(out.o, ref_o), commit_err, ref_o


def gdn_correctness(device, smoke: bool, failed: list, kernels: list[str], deadline: float) -> list[str]:
    """Triton verify/commit and the recurrent baseline against the float64 recurrence;
    each of ``kernels`` (that takes the case's N) also verifies every case. No case
    starts after ``deadline``."""
    cases = [
        # B, N, H, HV, K, V, tree shape (triton_ops.testing), partial node counts, state dtype
        (3, 40, 2, 4, 16, 32, "bushy", True, torch.float32),
        (2, 64, 1, 3, 64, 64, "chain", False, torch.float32),
        (4, 128, 2, 6, 128, 128, "bushy", True, torch.float32),
        (5, 128, 16, 48, 128, 128, "forest", True, torch.float32),
        (2, 100, 1, 2, 128, 128, "forest", True, torch.bfloat16),
        (1, 64, 16, 48, 128, 128, "random", False, torch.float32),
        (2, 48, 16, 48, 128, 128, "bushy", True, "bf16 inputs"),
        (3, 128, 16, 48, 128, 128, "bushy", True, "bf16 inputs"),
        # The engine's budget-64 tree: 65 nodes, the peeled tile kernel's one 64-row block
        # (the tile kernel adds a 16-row second block).
        (3, 65, 16, 48, 128, 128, "random", True, "bf16 inputs"),
        (2, 80, 2, 6, 128, 128, "forest", True, torch.float32),
    ]
    if smoke:
        cases = [c for c in cases if c[4] <= 64][:2]
    rows = []
    gen = torch.Generator().manual_seed(0)
    for B, N, H, HV, K, V, shape, partial, state_dtype in cases:
        if time.monotonic() > deadline:
            rows.append([f"{B}x{N}x{H}/{HV}x{K}", "(out of time)"] + [""] * (5 + len(kernels)))
            continue
        # Partial: the first request full, the others random counts (padding).
        counts = None if partial else [N] * B
        meta = random_tree_metadata(gen, [shape] * B, N, counts, device=device)
        # "bf16 inputs": bf16 q/k/v/beta (the 16-bit dot path), fp32 state.
        low = state_dtype == "bf16 inputs"
        state_dtype = torch.float32 if low else state_dtype
        dtype = torch.bfloat16 if low else torch.float32
        q, k, v, g, beta, pool, slots = gdn_inputs(gen, B, N, H, HV, K, V, dtype, device)
        pool = pool.to(state_dtype)
        out = gdn_tree_verify(q, k, v, g, beta, pool, slots, meta)
        pad = ~meta.valid
        pad_ok = all(bool((t[pad] == 0).all()) for t in (out.o, out.delta, out.gate_sum, out.k_normed))
        verify_err, commit_err, ref_o = gdn_errors((q, k, v, g, beta, pool, slots), meta)
        rec_o, _ = fused_recurrent_gdn_tree(q, k, v, g, beta, pool, slots, meta)
        errs = (verify_err, commit_err, rel_err(rec_o, ref_o))
        # bf16 state or output rounds at ~4e-3; the fp32 commit of bf16 inputs stays tight.
        tol = 1e-5 if state_dtype == torch.float32 and not low else 1e-2
        passed = pad_ok and max(errs) < tol and (not low or commit_err < 1e-5)
        kernel_cells = []
        for kernel in kernels:
            if not kernel_takes(kernel, N):
                kernel_cells.append("-")
                continue
            out = verify_triton(q, k, v, g, beta, pool, slots, meta, K**-0.5, True, "tf32x3", kernel=kernel)
            pad_ok = all(bool((t[pad] == 0).all()) for t in (out.o, out.delta, out.gate_sum, out.k_normed))
            k_verify, k_commit, _ = gdn_errors((q, k, v, g, beta, pool, slots), meta, kernel=kernel)
            passed &= pad_ok and max(k_verify, k_commit) < tol and (not low or k_commit < 1e-5)
            kernel_cells.append(f"{fmt_err(k_verify)} / {fmt_err(k_commit)}" + ("" if pad_ok else " PAD"))
        if not passed:
            failed.append(f"gdn {B}x{N} {shape}")
        rows.append([
            f"{B}x{N}x{H}/{HV}x{K}", shape + ("+pad" if partial else ""),
            "bf16 in" if low else str(state_dtype).split(".")[-1],
            *(fmt_err(e) for e in errs), *kernel_cells, "ok" if passed else "FAIL",
        ])
    header = ["B x N x H/HV x K", "tree", "state", "verify err", "commit err", "recurrent err",
              *(f"{kernel} verify / commit" for kernel in kernels), "check"]
    return table("GDN tree: kernels vs float64 per-node recurrence (relative norm error)", header, rows)


def gdn_precision_table(device, smoke: bool, failed: list, deadline: float) -> list[str]:
    """Verify and commit error vs float64 at the model's head shape, per dot precision
    (each precision is a compile of every kernel: fp32 inputs only, one N per kernel path)."""
    H, HV, K, V = (2, 4, 16, 16) if smoke else (16, 48, 128, 128)
    rows = []
    gen = torch.Generator().manual_seed(1)
    for N in (16, 64) if smoke else (64, 128):
        if time.monotonic() > deadline:
            break
        meta = random_tree_metadata(gen, ["bushy", "random"], N, [N, N], device=device)
        for dtype in (torch.float32,):
            inputs = gdn_inputs(gen, 2, N, H, HV, K, V, dtype, device)
            cells = []
            for precision in PRECISIONS:
                verify_err, commit_err, _ = gdn_errors(inputs, meta, precision)
                cells += [fmt_err(verify_err), fmt_err(commit_err)]
                # tf32x3 and ieee must keep fp32 accuracy where the output is fp32.
                if precision != "tf32" and dtype == torch.float32 and max(verify_err, commit_err) > 1e-5:
                    failed.append(f"gdn precision {precision} N={N}")
            rows.append([str(N), str(dtype).split(".")[-1], *cells])
    header = ["N", "inputs"] + [f"{p} {part}" for p in PRECISIONS for part in ("verify", "commit")]
    return table(f"GDN tree: error vs float64 by dot precision (B=2, H={H}, HV={HV}, K=V={K}, "
                 "fp32 inputs and state)", header, rows)


def fla_chunk():
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    return chunk_gated_delta_rule


def vllm_spec_kernel():
    """vLLM's GDN spec-decode kernel (fused sigmoid gating + recurrent delta rule)."""
    try:
        from vllm.third_party.flash_linear_attention.ops import fused_sigmoid_gating_delta_rule_update
    except Exception:  # noqa: BLE001 - absent or not importable on this machine
        return None
    return fused_sigmoid_gating_delta_rule_update


def fla_chain_calls(chunk, sets):
    """fla's chunk kernel on each layer's inputs as one chain per request; fla takes the
    states gathered and [B, HV, K, V]-contiguous and q / k / v contiguous (as vLLM's
    ``rearrange_mixed_qkv`` hands them over), copied outside the timing."""
    states = [s[5][s[6].long()].contiguous() for s in sets]
    inputs = [[t.contiguous() for t in s[:5]] for s in sets]

    def call(i):
        return chunk(*inputs[i], initial_state=states[i], output_final_state=True,
                     use_qk_l2norm_in_kernel=True)

    return call


def vllm_spec_calls(spec, sets, B, N, HV):
    """vLLM's spec-decode path at B x N tokens: each request a chain of N tokens whose
    per-token states go to their own slots (vLLM's layout), gates from raw a/b."""
    device = sets[0][0].device
    layer_args = []
    for q, k, v, g, beta, pool, slots in sets:
        K = q.shape[-1]
        states = torch.zeros(B * N + 1, HV, pool.shape[-1], K, device=device)
        states[: B * N].copy_(pool[slots.long()].transpose(-1, -2).repeat_interleave(N, 0))
        layer_args.append(dict(
            A_log=torch.zeros(HV, device=device), a=g.reshape(B * N, HV).to(q.dtype),
            b=beta.reshape(B * N, HV), dt_bias=torch.zeros(HV, device=device),
            q=q.reshape(1, B * N, *q.shape[2:]), k=k.reshape(1, B * N, *k.shape[2:]),
            v=v.reshape(1, B * N, *v.shape[2:]), initial_state=states, inplace_final_state=True,
            cu_seqlens=torch.arange(0, B * N + 1, N, device=device, dtype=torch.int32),
            ssm_state_indices=torch.arange(B * N, device=device, dtype=torch.int32).view(B, N),
            num_accepted_tokens=torch.ones(B, device=device, dtype=torch.int32),
            use_qk_l2norm_in_kernel=True,
        ))
    return lambda i: spec(**layer_args[i])


def check_table_errors(failed: list, name: str, verify_err: float, commit_err: float) -> None:
    """A timing row's own check: bf16 output within bf16 rounding, fp32 commit within 1e-5
    of float64; NaN never passes."""
    if not (math.isfinite(verify_err) and verify_err < 1e-2 and math.isfinite(commit_err) and commit_err < 1e-5):
        failed.append(name)


def verify_between_gemms(sets, device, verify) -> float:
    """Microseconds of ``verify(s)`` for each input set s when it runs, as in the model,
    right after a GEMM of the GDN layer's input projection (hidden 5120 -> 16384, which
    streams 168 MB of weights through L2): a graph of (GEMM, verify) per layer less a graph
    of the GEMMs alone. The engine's verify took 51 us per layer where this table's plain
    graph took 38 (H100, 65 x 1, the same compiled variant; BENCHMARKS.md, stop 25)."""
    if device.type != "cuda":
        return float("nan")
    from vllm_tfm.training.bench_training import QWEN36_27B_TARGET

    _, fan_in, fan_out, _ = target_linears(QWEN36_27B_TARGET)[0]  # the GDN input projection
    q = sets[0][0]
    weight = torch.randn(fan_out, fan_in, device=device, dtype=torch.bfloat16)
    x = torch.randn(q.shape[0] * q.shape[1], fan_in, device=device, dtype=torch.bfloat16)
    gemm = lambda: torch.nn.functional.linear(x, weight)  # noqa: E731
    both = [fn for s in sets for fn in (gemm, lambda s=s: verify(s))]
    return 2 * time_graph(both, device) - time_graph([gemm] * len(sets), device)


def gdn_timing_table(device, args, bandwidth: float, deadline: float) -> list[str]:
    smoke = args.smoke
    H, HV, K, V = (2, 4, 16, 16) if smoke else (16, 48, 128, 128)
    # 65: a budget-64 tree (root + 64 drafted nodes), the engine's default step.
    Ns = (16,) if smoke else (16, 32, 64, 65, 128)
    Bs = (1, 2) if smoke else (1, 8, 32)
    chunk = None if args.skip_baselines or device.type != "cuda" else fla_chunk()
    spec = None if args.skip_baselines or device.type != "cuda" else vllm_spec_kernel()
    rows = []
    gen = torch.Generator().manual_seed(3)
    # The key shapes first, so that a cut-off run still has them; printed in (N, B) order.
    key = [(65, 1), (64, 1), (128, 1), (64, 32), (65, 8), (64, 8)]
    shapes = [s for s in key if s[0] in Ns and s[1] in Bs] + [(N, B) for N in Ns for B in Bs if (N, B) not in key]
    if args.gdn_shapes and not smoke:
        shapes = args.gdn_shapes
    for N, B in shapes:
        if time.monotonic() > deadline:
            rows.append([str(N), str(B), "(out of time)"] + [""] * (12 + 2 * len(args.kernels)))
            continue
        state_bytes = B * HV * K * V * 4
        in_bytes = B * N * (2 * H * K * 2 + HV * V * 2 + HV * (4 + 2))
        out_bytes = B * N * (HV * V * (2 + 4) + HV * 8 + H * K * 4)
        layers = layers_for(state_bytes + in_bytes + out_bytes)
        meta = random_tree_metadata(gen, ["bushy"] * B, N, [N] * B, device=device)
        sets = [gdn_inputs(gen, B, N, H, HV, K, V, torch.bfloat16, device) for _ in range(layers)]
        outs = [gdn_tree_verify(*s, meta) for s in sets]
        leaf = torch.full((B,), N - 1, device=device)
        depth = int(meta.depths[0, N - 1]) + 1
        with ClockSampler() as clocks:
            verify_graph = guarded("verify graph", lambda: time_graph(
                [lambda s=s: gdn_tree_verify(*s, meta) for s in sets], device))
        verify_after_gemm = guarded("verify after GEMM", lambda: verify_between_gemms(
            sets, device, lambda s: gdn_tree_verify(*s, meta)))
        commit_graph = guarded("commit graph", lambda: time_graph(
            [lambda s=s, o=o: gdn_tree_commit(s[5], s[6], meta, o, leaf) for s, o in zip(sets, outs)],
            device,
        ))
        # The engine's commit: every layer in one launch (its table made by the eager call
        # before the capture).
        pools, slots = [s[5] for s in sets], [s[6] for s in sets]
        commit_layers_graph = guarded("commit layers graph", lambda: time_graph(
            [lambda: gdn_tree_commit_layers(pools, slots, meta, outs, leaf)], device) / layers)
        del outs
        rec_graph = fla_graph = spec_graph = float("nan")
        if not args.skip_baselines:
            node_states = torch.empty(B, N, HV, K, V, dtype=torch.float32, device=device)
            rec_graph = guarded("recurrent graph", lambda: time_graph(
                [lambda s=s: fused_recurrent_gdn_tree(*s, meta, node_states=node_states) for s in sets],
                device,
            ))
            del node_states
        if chunk is not None:
            call = fla_chain_calls(chunk, sets)
            fla_graph = guarded("fla chunk", lambda: time_graph(
                [lambda i=i: call(i) for i in range(layers)], device))
        if spec is not None:
            # Its per-token states take N times the pool: half the layers keep memory in bounds.
            spec_layers = max(1, layers // 2)

            def time_spec():
                call = vllm_spec_calls(spec, sets[:spec_layers], B, N, HV)
                return time_graph([lambda i=i: call(i) for i in range(spec_layers)], device)

            spec_graph = guarded("vLLM spec", time_spec)
        errors = guarded("errors", lambda: gdn_errors(sets[0], meta, first=2)[:2])
        verify_err, commit_err = errors if isinstance(errors, tuple) else (errors, errors)
        check_table_errors(args.failed, f"gdn {N}x{B} default", verify_err, commit_err)
        kernel_cells = []
        for kernel in args.kernels:
            if not kernel_takes(kernel, N):
                kernel_cells += ["-", "-"]
                continue
            us = guarded(f"verify {kernel}", lambda: time_graph(
                [lambda s=s: verify_triton(*s, meta, K**-0.5, True, "tf32x3", kernel=kernel) for s in sets],
                device))
            errors = guarded(f"errors {kernel}", lambda: gdn_errors(sets[0], meta, first=2, kernel=kernel)[:2])
            errors = errors if isinstance(errors, tuple) else (errors, errors)
            check_table_errors(args.failed, f"gdn {N}x{B} {kernel}", *errors)
            kernel_cells += [fmt(us), fmt_err(max(errors))]
        verify_floor = 1e6 * (state_bytes + in_bytes + out_bytes) / bandwidth
        commit_bytes = 2 * state_bytes + B * depth * (H * K * 4 + HV * V * 4 + HV * 8)
        commit_floor = 1e6 * commit_bytes / bandwidth
        rows.append([
            str(N), str(B), fmt(verify_graph), fmt(verify_after_gemm), sm_clock(clocks), fmt(verify_floor),
            fmt(commit_graph),
            fmt(commit_layers_graph), fmt(commit_floor),
            fmt(rec_graph), fmt(fla_graph), fmt(spec_graph),
            fmt(fla_graph / verify_graph, 2), fmt_err(verify_err), fmt_err(commit_err), *kernel_cells,
        ])
        del sets
        if device.type == "cuda":
            torch.cuda.empty_cache()
    rows.sort(key=lambda row: (int(row[0]), int(row[1])))
    header = ["N", "B", "verify", "verify after GEMM", "SM MHz", "verify floor", "commit", "commit, one launch",
              "commit floor", "per-node-state",
              "fla chain", "vLLM spec", "fla/verify", "verify err", "commit err"]
    header += [f"{kernel}{part}" for kernel in args.kernels for part in ("", " err")]
    return table(
        f"GDN tree, us per layer under CUDA graphs (H={H}, HV={HV}, K=V={K}, bf16 q/k/v as views of one fused "
        "conv output (the tree path's layout since stop 21), fp32 state "
        f"in vLLM's [slots, HV, V, K] layout, bushy trees; floor = bytes / "
        f"{fmt(bandwidth / 1e12, 2)} TB/s; per-node-state = fused_recurrent_gdn_tree writing every "
        "node's state; verify after GEMM = each layer's verify after a GEMM of the layer's qkvz "
        "projection shape, as in the model (its 168 MB of weights through L2), less the GEMMs alone; "
        "SM MHz: median SM clock while verify was timed (nvidia-smi); commit, one "
        "launch = gdn_tree_commit_layers over every layer of the graph (the engine's), per layer; "
        "fla chain = "
        "fla's chunk_gated_delta_rule on a chain of N; vLLM spec = vLLM's "
        "fused_sigmoid_gating_delta_rule_update on B chains of N tokens, per-token states; errors: "
        "bf16 output and fp32 committed state vs float64, first 2 requests)",
        header, rows,
    )


def gdn_padding_table(device, args, deadline: float) -> list[str]:
    """Verify time by the real node count inside a batch padded to N = 128."""
    if args.smoke or device.type != "cuda":
        return []
    H, HV, K, V = 16, 48, 128, 128
    gen = torch.Generator().manual_seed(5)
    rows = []
    for B in (8, 32):
        for label, counts in (("all 128", [128] * B), ("all 64", [64] * B),
                              ("uniform 1..128", torch.randint(1, 129, (B,), generator=gen).tolist())):
            if time.monotonic() > deadline:
                break
            meta = random_tree_metadata(gen, ["bushy"] * B, 128, counts, device=device)
            sets = [gdn_inputs(gen, B, 128, H, HV, K, V, torch.bfloat16, device) for _ in range(2)]
            us = guarded("padding", lambda: time_graph([lambda s=s: gdn_tree_verify(*s, meta) for s in sets], device))
            rows.append([str(B), label, str(sum(counts)), fmt(us)])
    return table("GDN tree verify with padding: batch padded to N = 128, real node counts vary "
                 "(us per layer, CUDA graph)", ["B", "node counts", "real nodes", "verify"], rows)


class SweepConfig(NamedTuple):
    """A verify launch configuration the sweep times (``verify_triton``'s knobs)."""

    block_v: int  # output / tile kernel's V columns
    num_warps: int  # and its warps
    prepare_warps: int = 4
    precision: str = "tf32x3"
    k_chunk: int | None = None  # None: chunk_triton.K_CHUNK
    fuse_parts: bool = FUSE_STATE_PARTS


# Launch configurations the sweep times per verify kernel.
SWEEP_CONFIGS = {
    "default": [SweepConfig(bv, w) for bv in (32, 64, 128) for w in (4, 8)]
    + [SweepConfig(32, 4, 8), SweepConfig(64, 8, 8), SweepConfig(32, 4, precision="tf32"),
       SweepConfig(32, 4, precision="ieee")],
    # No prepare kernel: BV, warps, the K chunk and the state parts in one dot or three. sm_90
    # spill stack, 4 warps: N = 64 BV 32 / 64 / 128 256 / 680 / 1640 B; N = 128 BV 32 / 64
    # 784 / 1456 B (the default: BV 64 from 128 heads). K chunk 128 and the fused parts at
    # 65 x 1: fewer wgmma waits (chunk_triton.K_CHUNK, FUSE_STATE_PARTS).
    "tile": [SweepConfig(bv, w) for bv in (32, 64, 128) for w in (4, 8)]
    + [SweepConfig(32, w, k_chunk=128) for w in (4, 8)]
    + [SweepConfig(32, 4, fuse_parts=not FUSE_STATE_PARTS)],  # 8 warps never fuse (fuses_parts)
}
SWEEP_CONFIGS["peeled_tile"] = SWEEP_CONFIGS["tile"]


# A launch configuration's bf16 verify output may differ from the default path's by a few
# bf16 ulps (2^-8 relative; 6e-3 of max |o| seen against the PyTorch path on CPU); a wrong
# result differs by O(1).
CONFIG_SWEEP_TOLERANCE = 3e-2


def gdn_config_sweep(device, args, deadline: float) -> list[str]:
    """Verify time per launch configuration of ``args.sweep_kernel`` (CUDA graph), alone
    and right after a GEMM as in the model (``verify_between_gemms``), each configuration's
    output checked against gdn_tree_verify's default path first (``--smoke``: tiny shapes,
    the checks alone). Shapes: ``--gdn-shapes``, else (128, 1), (64, 8), (128, 8), (64, 32).
    Configurations the launched kernel does not take (``kernel_takes_warps``) are left out."""
    if not args.sweep:
        return []
    H, HV, K, V = (2, 4, 32, 32) if args.smoke else (16, 48, 128, 128)
    shapes = ((17, 1), (9, 2)) if args.smoke else args.gdn_shapes or ((128, 1), (64, 8), (128, 8), (64, 32))
    rows = []
    gen = torch.Generator().manual_seed(4)
    kernel = None if args.sweep_kernel == "default" else args.sweep_kernel
    configs = [c for c in SWEEP_CONFIGS.get(args.sweep_kernel, SWEEP_CONFIGS["default"]) if c.block_v <= V]
    for N, B in shapes:
        if kernel is not None and not kernel_takes(kernel, N):
            continue
        meta = random_tree_metadata(gen, ["bushy"] * B, N, [N] * B, device=device)
        sets = [gdn_inputs(gen, B, N, H, HV, K, V, torch.bfloat16, device) for _ in range(8 if B == 1 else 2)]
        expected = gdn_tree_verify(*sets[0], meta).o.float()
        launched = kernel or default_verify_kernel(N, B * HV)
        for config in configs:
            if not kernel_takes_warps(launched, config.num_warps):
                continue
            if time.monotonic() > deadline:
                break

            def call(s, config=config):
                q, k, v, g, beta, pool, slots = s
                return verify_triton(q, k, v, g, beta, pool, slots, meta, K**-0.5, True, config.precision,
                                     block_v=config.block_v, num_warps=config.num_warps,
                                     prepare_warps=config.prepare_warps, kernel=kernel, k_chunk=config.k_chunk,
                                     fuse_parts=config.fuse_parts)

            chunk = str(key_chunk(K, config.k_chunk))
            parts = "one dot" if fuses_parts(config.fuse_parts, config.num_warps) else "three"
            label = (f"verify BV={config.block_v} warps={config.num_warps}/{config.prepare_warps} "
                     f"{config.precision} K chunk {chunk} parts {parts} (N={N}, B={B})")
            head = [str(N), str(B), str(config.block_v), str(config.num_warps), str(config.prepare_warps),
                    config.precision, chunk, parts]
            error = float((call(sets[0]).o.float() - expected).abs().max() / expected.abs().max())
            if not error < CONFIG_SWEEP_TOLERANCE:
                args.failed.append(label)
                rows.append(head + [fmt_err(error), "FAILED", ""])
                continue
            us = guarded(label, lambda: time_graph([lambda s=s: call(s) for s in sets], device))
            after_gemm = guarded(label + " after GEMM", lambda: verify_between_gemms(sets, device, call))
            rows.append(head + [fmt_err(error), fmt(us), fmt(after_gemm)])
    return table(f"GDN tree verify launch configurations, kernel {args.sweep_kernel} (us per layer, CUDA "
                 "graph; after GEMM: each layer's verify right after its input projection; error: max "
                 "difference from gdn_tree_verify's default path over max |o|)",
                 ["N", "B", "output BV", "output warps", "prepare warps", "precision", "K chunk",
                  "state parts (tile, 64 rows)", "error", "graph", "after GEMM"], rows)


# The commit's state tiles and warps the sweep times: (BK, BV, warps); the first is the
# default. At batch 1 the default's 192 programs are half a wave (BENCHMARKS.md, issue 13).
COMMIT_SWEEP = [(64, 64, 4), (64, 32, 4), (32, 64, 4), (32, 32, 4), (32, 32, 2), (16, 32, 2),
                (32, 16, 2), (16, 16, 1), (64, 64, 8)]


def gdn_commit_sweep(device, args, deadline: float) -> list[str]:
    """Commit time per state tile and warps (CUDA graph) over the model's 48 GDN layers, a
    launch per layer and all in one launch (the engine's), each tile checked against the
    default's committed states first (``--smoke``: tiny shapes, the checks alone)."""
    if not args.sweep:
        return []
    H, HV, K, V = (2, 4, 32, 32) if args.smoke else (16, 48, 128, 128)
    shapes = ((17, 1), (9, 2)) if args.smoke else ((65, 1), (64, 1), (17, 8), (65, 8), (17, 32))
    num_layers = 2 if args.smoke else MODEL_GDN_LAYERS
    rows = []
    gen = torch.Generator().manual_seed(5)
    for N, B in shapes:
        meta = random_tree_metadata(gen, ["bushy"] * B, N, [N] * B, device=device)
        sets = [gdn_inputs(gen, B, N, H, HV, K, V, torch.bfloat16, device) for _ in range(num_layers)]
        outs = [gdn_tree_verify(*s, meta) for s in sets]
        layers = commit_layer_table([s[5] for s in sets], [s[6] for s in sets], outs)
        leaf = torch.full((B,), N - 1, device=device)
        for bk, bv, warps in COMMIT_SWEEP:
            if time.monotonic() > deadline:
                break

            def call(s, out, bk=bk, bv=bv, warps=warps, layers=None):
                commit_triton(s[5], s[6], meta, out, leaf, DEFAULT_PRECISION, block_k=bk,
                              block_v=bv, num_warps=warps, layers=layers)

            label = f"commit BK={bk} BV={bv} warps={warps} (N={N}, B={B})"
            pool = sets[0][5]
            default, tuned = pool.clone(), pool.clone()
            commit_triton(default, sets[0][6], meta, outs[0], leaf, DEFAULT_PRECISION)
            call((*sets[0][:5], tuned, sets[0][6]), outs[0])
            error = rel_err(tuned, default.double())
            if not error < 1e-6 or torch.equal(default, pool):  # nothing committed: no check
                args.failed.append(label)
                rows.append([str(N), str(B), str(bk), str(bv), str(warps), fmt_err(error), "FAILED"])
                continue
            us = guarded(label, lambda: time_graph([lambda s=s, o=o: call(s, o)
                                                    for s, o in zip(sets, outs)], device))
            one_launch = guarded(label + ", one launch", lambda: time_graph(
                [lambda: call(sets[0], outs[0], layers=layers)], device) / num_layers)
            rows.append([str(N), str(B), str(bk), str(bv), str(warps), fmt_err(error), fmt(us),
                         fmt(one_launch)])
        del sets, outs
    return table(f"GDN tree commit state tiles (us per layer, CUDA graph over {num_layers} layers: a "
                 "launch per layer, and all in one launch; error vs the default tile)",
                 ["N", "B", "BK", "BV", "warps", "rel err", "graph", "one launch"], rows)


PROFILED_GDN_SHAPES = ((65, 1), (17, 8), (128, 1))


def gdn_launches_for_profiler(device, kernels: list[str]) -> list[str]:
    """Only launch verify + commit twice at the key shapes (the engine's 65-node tree at
    B = 1, its 17-node trees at B = 8, and 128 nodes), and each of ``kernels`` twice, for a
    profiler to read
    (``ncu -k regex:"_verify|_commit" python tools/bench_kernels.py --profile-gdn``)."""
    gen = torch.Generator().manual_seed(6)
    for N, B in PROFILED_GDN_SHAPES:
        meta = random_tree_metadata(gen, ["bushy"] * B, N, [N] * B, device=device)
        inputs = gdn_inputs(gen, B, N, 16, 48, 128, 128, torch.bfloat16, device)
        leaf = torch.full((B,), N - 1, device=device)
        for _ in range(2):
            gdn_tree_commit(inputs[5], inputs[6], meta, gdn_tree_verify(*inputs, meta), leaf)
            for kernel in kernels:
                if kernel_takes(kernel, N):
                    verify_triton(*inputs, meta, 128**-0.5, True, "tf32x3", kernel=kernel)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return [f"GDN verify + commit (and {kernels}) launched at (N, B) = {PROFILED_GDN_SHAPES}, twice each",
            ""]


GDN_SECTIONS = ("correctness", "timing", "precision", "padding", "sweep", "commit-sweep")


def bench_gdn(args) -> list[str]:
    device = args.device
    deadline = time.monotonic() + args.budget_s
    sections = {
        "correctness": lambda: gdn_correctness(device, args.smoke, args.failed, args.kernels, deadline),
        "timing": lambda: gdn_timing_table(device, args, copy_bandwidth(device), deadline),
        "precision": lambda: gdn_precision_table(device, args.smoke, args.failed, deadline),
        "padding": lambda: gdn_padding_table(device, args, deadline),
        "sweep": lambda: gdn_config_sweep(device, args, deadline),
        "commit-sweep": lambda: gdn_commit_sweep(device, args, deadline),
    }
    assert tuple(sections) == GDN_SECTIONS
    return run_sections("gdn", [sections[name] for name in args.gdn_sections], args)


# --- tree conv1d ----------------------------------------------------------------------------


def conv_inputs(gen, B, N, C, W, dtype, device):
    x = torch.randn(B, N, C, generator=gen).to(device=device, dtype=dtype)
    weight = (torch.randn(C, W, generator=gen) / W).to(device=device, dtype=dtype)
    bias = torch.randn(C, generator=gen).to(device=device, dtype=dtype)
    # vLLM keeps the conv state dim-last: [slots, W-1, C] viewed as [slots, C, W-1].
    state = torch.randn(B + 2, W - 1, C, generator=gen).to(device=device, dtype=dtype).transpose(1, 2)
    slots = torch.randperm(B + 2, generator=gen)[:B].to(device=device, dtype=torch.int32)
    return x, weight, bias, state, slots


def conv_correctness(device, failed: list) -> list[str]:
    from triton_ops.tree_conv import (
        naive_tree_conv1d,
        naive_tree_conv1d_commit,
        tree_conv1d,
        tree_conv1d_commit,
        tree_conv1d_commit_layers,
    )

    gen = torch.Generator().manual_seed(10)
    rows = []
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2), (torch.float16, 1e-2)):
        for W in (2, 4):
            B, N, C = 3, 40, 1000
            meta = random_tree_metadata(gen, ["random", "forest", "star"], N, [40, 17, 1], W, device=device)
            x, weight, bias, state, slots = conv_inputs(gen, B, N, C, W, dtype, device)
            y = tree_conv1d(x, weight, bias, state, slots, meta)
            cpu = [t.cpu() for t in (x, weight, bias, state, slots)]
            ref = naive_tree_conv1d(*cpu, meta_on(meta, "cpu"))
            check_row(rows, failed, f"conv {str(dtype).split('.')[-1]} W={W}", rel_err(y, ref), tol)
            leaf = torch.tensor([39, 5, -1], device=device)
            new_state = state.clone()
            tree_conv1d_commit(new_state, slots, x, meta, leaf)
            expected = naive_tree_conv1d_commit(cpu[3], cpu[4], cpu[0], meta_on(meta, "cpu"), leaf.cpu())
            check_row(rows, failed, f"conv commit {str(dtype).split('.')[-1]} W={W} (bit-exact)",
                      0.0 if same_bits(new_state, expected) else math.inf, 0.0)
            layers = [state.clone(), state.clone()]
            tree_conv1d_commit_layers(layers, [slots] * 2, [x] * 2, meta, leaf)
            check_row(rows, failed, f"conv commit, 2 layers in one launch {str(dtype).split('.')[-1]} "
                      f"W={W} (bit-exact)",
                      0.0 if all(same_bits(layer, expected) for layer in layers) else math.inf, 0.0)
    return table("tree conv1d vs float64 reference", ["case", "error", "tol", "check"], rows)


def conv_timing_table(device, args, bandwidth: float) -> list[str]:
    from triton_ops.tree_conv import (
        tree_conv1d,
        tree_conv1d_commit,
        tree_conv1d_commit_layers,
    )

    C, W = (64, 4) if args.smoke else (10240, 4)
    gen = torch.Generator().manual_seed(11)
    rows = []
    for B in (1, 2) if args.smoke else (1, 8, 32):
        for N in (16,) if args.smoke else (16, 32, 64, 128):
            meta = random_tree_metadata(gen, ["random"] * B, N, [N] * B, W, device=device)
            x, weight, bias, state, slots = conv_inputs(gen, B, N, C, W, torch.bfloat16, device)
            out = torch.empty_like(x)
            leaf = torch.full((B,), N - 1, device=device)
            conv = lambda: tree_conv1d(x, weight, bias, state, slots, meta, out=out)  # noqa: E731
            commit = lambda: tree_conv1d_commit(state, slots, x, meta, leaf)  # noqa: E731
            floor = (2 * x.numel() * 2 + B * (W - 1) * C * 2) / bandwidth * 1e6
            # The engine's commit: GRAPH_REPEATS layers of their own in one launch.
            layers = [conv_inputs(gen, B, N, C, W, torch.bfloat16, device) for _ in range(GRAPH_REPEATS)]
            states, layer_slots, xs = ([layer[i] for layer in layers] for i in (3, 4, 0))
            commit_layers = lambda: tree_conv1d_commit_layers(  # noqa: E731
                states, layer_slots, xs, meta, leaf)
            rows.append([str(B), str(N), fmt(time_eager(conv, device)),
                         fmt(time_graph([conv] * GRAPH_REPEATS, device)), fmt(floor),
                         fmt(time_graph([commit] * GRAPH_REPEATS, device)),
                         fmt(time_graph([commit_layers], device) / GRAPH_REPEATS)])
            del layers, states, layer_slots, xs
    return table(f"tree conv1d, C={C}, W={W}, bf16 (us; graph = {GRAPH_REPEATS} calls under one CUDA graph, per call; "
                 f"commit, one launch = tree_conv1d_commit_layers over {GRAPH_REPEATS} layers, per layer)",
                 ["B", "N", "conv eager", "conv graph", "bytes floor", "commit graph", "commit, one launch"],
                 rows)


def conv_tile_sweep(device, args) -> list[str]:
    """Conv time per tile configuration; the tables after it use the fastest."""
    if device.type != "cuda" or not args.sweep:
        return []
    import triton_ops.tree_conv.conv as conv_module
    from triton_ops.tree_conv.conv import launch_tree_conv1d

    C = 10240
    gen = torch.Generator().manual_seed(12)
    configs = [(16, 256, 4), (32, 256, 4), (64, 256, 8), (8, 512, 4), (16, 512, 4), (32, 512, 8),
               (16, 1024, 8), (64, 128, 4)]
    rows, totals = [], [0.0] * len(configs)
    for B, N in ((1, 64), (8, 64), (32, 128)):
        meta = random_tree_metadata(gen, ["random"] * B, N, [N] * B, device=device)
        x, weight, bias, state, slots = conv_inputs(gen, B, N, C, 4, torch.bfloat16, device)
        out = torch.empty_like(x)
        times = [time_graph([lambda tiles=tiles: launch_tree_conv1d(
            x, weight, bias, state, slots, meta, "silu", out, *tiles)] * GRAPH_REPEATS, device)
            for tiles in configs]
        rows.append([str(B), str(N), *(fmt(t) for t in times)])
        totals = [total + t for total, t in zip(totals, times)]
    conv_module.CUDA_TILES = configs[min(range(len(configs)), key=totals.__getitem__)]
    return table(f"tree conv tiles, C={C}, W=4, bf16 (us, graph; block_n x block_c / warps); the tables "
                 f"use {conv_module.CUDA_TILES}",
                 ["B", "N", *(f"{n}x{c}/{w}" for n, c, w in configs)], rows)


def bench_conv(args) -> list[str]:
    device = args.device
    sections = [
        lambda: conv_correctness(device, args.failed),
        lambda: conv_tile_sweep(device, args),
        lambda: conv_timing_table(device, args, copy_bandwidth(device)),
    ]
    return run_sections("conv", sections, args)


# --- tree attention and the tree KV commit --------------------------------------------------


def paged_cache(gen, lengths, Hkv, D, block_size, dtype, layout, device, num_layers=1):
    """Caches in an engine layout with random K/V at each request's [0, length)."""
    need = [-(-n // block_size) for n in lengths]
    num_blocks = sum(need) + 2
    if layout == "kv_stacked":  # FlashInfer-like [blocks, 2, bs, H, D]
        both = torch.empty(num_layers, num_blocks, 2, block_size, Hkv, D, dtype=dtype, device=device)
        keys, values = both[:, :, 0], both[:, :, 1]
    elif layout == "hnd":  # [blocks, H, bs, D] seen as [blocks, bs, H, D]
        shape = (num_layers, num_blocks, Hkv, block_size, D)
        keys = torch.empty(shape, dtype=dtype, device=device).transpose(2, 3)
        values = torch.empty(shape, dtype=dtype, device=device).transpose(2, 3)
    else:
        keys = torch.empty(num_layers, num_blocks, block_size, Hkv, D, dtype=dtype, device=device)
        values = torch.empty_like(keys)
    keys.normal_()
    values.normal_()
    table_ = torch.zeros(len(lengths), max(need), dtype=torch.int32)
    perm = torch.randperm(num_blocks, generator=gen)
    for b, n in enumerate(need):
        table_[b, :n], perm = perm[:n], perm[n:]
    return list(keys.unbind(0)), list(values.unbind(0)), table_.to(device)


def attention_correctness(device, smoke: bool, failed: list) -> list[str]:
    gen = torch.Generator().manual_seed(20)
    rows = []
    small = [  # dtype, D, Hkv, G, prefixes, block size, layout, window, soft cap, tol
        (torch.bfloat16, 256, 2, 3, (0, 300), 16, "hnd", None, None, 1e-2),
        (torch.float16, 128, 1, 2, (1, 517), 32, "kv_stacked", None, 30.0, 1e-2),
        (torch.bfloat16, 64, 2, 1, (77, 260), 16, "contiguous", 40, None, 1e-2),
        (torch.float32, 32, 2, 3, (5, 400), 16, "contiguous", None, None, 1e-5),
    ]
    for dtype, D, Hkv, G, prefixes, bs, layout, window, cap, tol in small[-1:] if smoke else small:
        N = 20
        meta = random_tree_metadata(gen, ["random", "forest"], N, [N, 11], device=device)
        keys, values, table_ = paged_cache(gen, [p + N for p in prefixes], Hkv, D, bs, dtype, layout, device)
        q = torch.randn(2, N, Hkv * G, D, generator=gen).to(device=device, dtype=dtype)
        prefix = torch.tensor(prefixes, dtype=torch.int32, device=device)
        out = torch.full_like(q, math.nan)
        paged_tree_attention(q, keys[0], values[0], table_, prefix, meta, D**-0.5, window, cap,
                             backend="triton", out=out)
        ref = naive_tree_attention(q.cpu(), keys[0].cpu(), values[0].cpu(), table_.cpu(), prefix.cpu(),
                                   meta_on(meta, "cpu"), D**-0.5, window, cap)
        check_row(rows, failed, f"attention {str(dtype).split('.')[-1]} D={D} G={G} {layout} "
                  f"window={window} cap={cap}", rel_err(out, ref), tol)
    if not smoke:
        # Qwen3.6-27B shapes, bf16, against the PyTorch path in fp32 on the same inputs:
        # mixed prefixes (0, not a multiple of the block or tile), padded trees, both
        # row-tile heights (N = 32 takes 64-row tiles), a window and a soft cap.
        for prefixes, N, window, cap in (((1000, 4097), 64, None, None), ((32768, 5), 128, None, None),
                                         ((8000, 3), 128, 1024, None), ((0, 2049), 32, None, None),
                                         ((517, 16), 16, None, 50.0), ((32768, 4), 64, None, None)):
            meta = random_tree_metadata(gen, ["random", "forest"], N, [N, N // 2 + 1], device=device)
            keys, values, table_ = paged_cache(gen, [p + N for p in prefixes], 4, 256, 16, torch.bfloat16,
                                               "hnd", device)
            q = torch.randn(2, N, 24, 256, generator=gen).to(device=device, dtype=torch.bfloat16)
            prefix = torch.tensor(prefixes, dtype=torch.int32, device=device)
            out = torch.full_like(q, math.nan)
            paged_tree_attention(q, keys[0], values[0], table_, prefix, meta, 256**-0.5, window, cap, out=out)
            ref = paged_tree_attention(q.float(), keys[0].float(), values[0].float(), table_, prefix,
                                       meta, 256**-0.5, window, cap, backend="torch")
            config = kernel_config(q, 4)
            check_row(rows, failed, f"attention 24/4 heads D=256 prefixes={prefixes} N={N} window={window} "
                      f"cap={cap} ({config.block_m}-row tiles, {config.num_splits} splits) vs torch fp32",
                      rel_err(out, ref), 1e-2)
            del keys, values
    for layout in ("contiguous", "kv_stacked", "hnd"):
        N = 16 if smoke else 64
        meta = random_tree_metadata(gen, ["random", "forest", "random"], N, [N, N // 2, 1], device=device)
        prefixes = (100, 7, 0)
        keys, values, table_ = paged_cache(gen, [p + N for p in prefixes], 2 if smoke else 4,
                                           32 if smoke else 256, 16, torch.bfloat16, layout, device, 4)
        prefix = torch.tensor(prefixes, dtype=torch.int32, device=device)
        leaf = torch.tensor([N - 1, N // 2 - 1, 0], device=device)
        ref_k, ref_v = [k.cpu() for k in keys], [v.cpu() for v in values]
        naive_tree_kv_commit(ref_k, ref_v, table_.cpu(), prefix.cpu(), meta_on(meta, "cpu"), leaf.cpu())
        tree_kv_commit(keys, values, table_, prefix, meta, leaf, backend="triton")
        ok = all(same_bits(a, b) for a, b in zip(keys + values, ref_k + ref_v))
        check_row(rows, failed, f"kv commit {layout} (bit-exact)", 0.0 if ok else math.inf, 0.0)
    return table("tree attention vs float64 reference (small) and the PyTorch path (model shapes); "
                 "tree KV commit vs naive", ["case", "error", "tol", "check"], rows)


def sdpa_inputs(q, keys, values, table_, prefixes, meta, N):
    """Contiguous [B, Hq, L, D] K/V (GQA expanded) and the dense bool mask SDPA needs."""
    B, _, Hq, D = q.shape
    device = q.device
    L = max(prefixes) + N
    pos = torch.arange(L, device=device)
    blk = table_.long()[:, (pos // keys.shape[1]).clamp(max=table_.shape[1] - 1)]
    group = Hq // keys.shape[2]
    k = keys[blk, pos % keys.shape[1]].transpose(1, 2).repeat_interleave(group, 1)
    v = values[blk, pos % keys.shape[1]].transpose(1, 2).repeat_interleave(group, 1)
    prefix = torch.tensor(prefixes, device=device).view(B, 1, 1)
    rel = pos.view(1, 1, L) - prefix
    tree = torch.gather(meta.ancestors, 2, rel.clamp(0, N - 1).expand(B, N, L))
    mask = (rel < 0) | (tree & (rel < N))
    return q.transpose(1, 2), k, v, mask.unsqueeze(1)


# SDPA needs the GQA-expanded K/V copied out: only where that copy stays small.
SDPA_MAX_BYTES = 4 << 30


def attention_inputs(gen, B, N, prefix_len, Hq, Hkv, D, device, num_layers=1):
    keys, values, table_ = paged_cache(gen, [prefix_len + N] * B, Hkv, D, 16, torch.bfloat16, "hnd", device,
                                       num_layers)
    meta = random_tree_metadata(gen, ["random"] * B, N, [N] * B, device=device)
    q = torch.randn(B, N, Hq, D, generator=gen).to(device=device, dtype=torch.bfloat16)
    prefix = torch.full((B,), prefix_len, dtype=torch.int32, device=device)
    return keys, values, table_, meta, q, prefix


# Qwen3.6-27B's attention (24 q / 4 kv heads of 256) under the engine's 65-node tree at
# B = 1: issue 13's key prefix (32k, where the kernel is compute-bound) and the engine's
# benchmark context (1k, launch-bound).
PROFILED_ATTENTION_SHAPES = ((1, 65, 32768), (1, 65, 1024))
PROFILED_ATTENTION_HEADS = (24, 4, 256)


def attention_launches_for_profiler(device, shapes=PROFILED_ATTENTION_SHAPES,
                                    heads=PROFILED_ATTENTION_HEADS) -> list[str]:
    """Only launch the tree attention (the engine's dispatch: split + merge) twice at each
    (B, N, prefix) of ``shapes`` with ``heads`` (q heads, kv heads, head dim), for a
    profiler to read (``ncu -k regex:_tree_attention python tools/bench_kernels.py
    --profile-attn``)."""
    gen = torch.Generator().manual_seed(23)
    Hq, Hkv, D = heads
    for B, N, prefix_len in shapes:
        keys, values, table_, meta, q, prefix = attention_inputs(gen, B, N, prefix_len, Hq, Hkv, D, device)
        for _ in range(2):
            paged_tree_attention(q, keys[0], values[0], table_, prefix, meta, D**-0.5, backend="triton")
    if device.type == "cuda":
        torch.cuda.synchronize()
    return [f"tree attention launched at (B, N, prefix) = {shapes}, twice each", ""]


def attention_timing_table(device, args, bandwidth: float, flops: float, deadline: float) -> list[str]:
    """Ours under CUDA graphs over distinct layers' caches (so that short prefixes do
    not sit in L2 between calls), against the bytes and compute floors."""
    Hq, Hkv, D = (4, 2, 32) if args.smoke else (24, 4, 256)
    gen = torch.Generator().manual_seed(21)
    # The key shapes and the engine's tree (65 nodes) first, so that a run cut by the
    # budget still has them.
    key_shapes = [(1, 64, 32768), (1, 128, 32768), (1, 65, 32768), (1, 65, 1024)]
    shapes = [(1, 16, 1024)] if args.smoke else key_shapes + [
        (B, N, prefix) for B in (1, 8, 32) for prefix in (1024, 8192, 32768) for N in (16, 32, 64, 128)
        if (B, N, prefix) not in key_shapes
    ]
    rows, skipped = [], 0
    for B, N, prefix_len in shapes:
        # The key shapes run whatever the budget (a sweep before may have spent it).
        if time.monotonic() > deadline and (B, N, prefix_len) not in key_shapes:
            skipped += 1
            continue
        L = prefix_len + N
        layer_bytes = B * L * Hkv * D * 2 * 2
        layers = layers_for(layer_bytes)
        keys, values, table_, meta, q, prefix = attention_inputs(gen, B, N, prefix_len, Hq, Hkv, D, device, layers)
        out = torch.empty_like(q)
        calls = [
            lambda i=i: paged_tree_attention(q, keys[i % layers], values[i % layers], table_, prefix, meta,
                                             D**-0.5, out=out)
            for i in range(GRAPH_REPEATS)
        ]
        ours, ours_graph = time_eager(calls[0], device), time_graph(calls, device)
        sdpa = float("nan")
        if not args.skip_baselines and device.type == "cuda" and B * Hq * L * D * 2 * 2 <= SDPA_MAX_BYTES:
            sq, sk, sv, mask = sdpa_inputs(q, keys[0], values[0], table_, [prefix_len] * B, meta, N)
            sdpa = guarded("sdpa", lambda: time_eager(lambda: torch.nn.functional.scaled_dot_product_attention(
                sq, sk, sv, attn_mask=mask, scale=D**-0.5), device))
            del sq, sk, sv, mask
        bytes_floor = layer_bytes / bandwidth * 1e6
        flops_floor = 4 * B * Hq * N * L * D / flops * 1e6
        config = kernel_config(q, Hkv)
        rows.append([str(B), str(N), str(prefix_len), f"{config.block_m}x{config.block_n}",
                     str(config.num_splits), fmt(ours), fmt(ours_graph), fmt(sdpa), fmt(bytes_floor),
                     fmt(flops_floor), fmt(ours_graph / max(bytes_floor, flops_floor), 2),
                     fmt(4 * B * Hq * N * L * D / (ours_graph * 1e-6) / 1e12, 0)])
        del keys, values, calls
        if device.type == "cuda":
            torch.cuda.empty_cache()  # B = 32 at 32k holds 2 GB of cache per layer
    header = ["B", "N", "prefix", "tiles", "splits", "ours eager", "ours graph", "SDPA", "bytes floor",
              "compute floor", "graph / floor", "TFLOP/s"]
    title = (f"tree attention, {Hq} q / {Hkv} kv heads, D={D}, bf16, block 16, HND cache (us; graph = "
             f"{GRAPH_REPEATS} calls over distinct layers per replay; bytes floor = K/V read once / "
             f"{fmt(bandwidth / 1e12, 2)} TB/s; compute floor = 4 B Hq N L D / {fmt(flops / 1e12, 0)} TFLOP/s"
             + (f"; {skipped} shapes skipped: past the budget" if skipped else "") + ")")
    args.attention_rows = (title, header, rows)
    return table(title, header, rows)


def markdown_table(title: str, header: list[str], rows: list[list[str]]) -> list[str]:
    return [f"**{title}**", "", "| " + " | ".join(header) + " |",
            "|" + "|".join("--:" for _ in header) + "|", *("| " + " | ".join(r) + " |" for r in rows), ""]


# Split-kernel candidates by row-tile height, (block_m, block_n, num_warps, num_stages,
# programs_per_sm, rescale_slack): the defaults first, then 32-key tiles with K/V two or
# three tiles ahead (164 / 192 KB of shared memory on sm_90), the textbook rescale every
# tile, and 16-key tiles two ahead for 64-row tiles (82 KB: still two programs per SM).
# The 64-row class also tries more warps in flight per SM, which stop 39's ncu profile
# named as the split kernel's lack: 8 warps on a 64-row tile (half the accumulator's
# registers per thread), 32-row tiles of 4 warps (mma.sync, half the accumulator and Q;
# each K/V tile read by twice as many programs), and K/V three tiles ahead. On the H100
# all of them lost, by 1.1-2.6x at 32k (BENCHMARKS.md, "Stop 40").
ATTENTION_CANDIDATES = {
    128: [(128, 64, 8, 2, 1, 8.0), (128, 32, 8, 4, 1, 8.0), (128, 32, 8, 3, 1, 8.0), (128, 64, 8, 2, 1, -1.0)],
    64: [(64, 32, 4, 2, 2, 8.0), (64, 16, 4, 3, 2, 8.0), (64, 32, 8, 2, 2, 8.0), (64, 32, 4, 3, 1, 8.0),
         (32, 32, 4, 2, 2, 8.0), (32, 32, 4, 3, 2, 8.0), (32, 16, 4, 3, 3, 8.0)],
}


def attention_sweep_case(gen, N, prefix_len, Hq, Hkv, D, device, smoke):
    """One request's tree of N nodes over a prefix for the split-kernel sweeps: (calls,
    out, ref) where ``calls(config)`` is one launch per layer over distinct layers' caches
    (so that short prefixes do not sit in L2), writing ``out``; ``ref`` is the PyTorch path
    in fp32. ``smoke``: fp32 inputs (the interpreter's bf16 is unreliable)."""
    from triton_ops.tree_attention.attention import launch_tree_attention

    layers = layers_for(prefix_len * Hkv * D * 2 * 2)
    keys, values, table_, meta, q, prefix = attention_inputs(gen, 1, N, prefix_len, Hq, Hkv, D, device, layers)
    if smoke:
        q, keys, values = q.float(), [k.float() for k in keys], [v.float() for v in values]
    out = torch.full_like(q, math.nan)
    ref = paged_tree_attention(q.float(), keys[0].float(), values[0].float(), table_, prefix, meta, D**-0.5,
                               backend="torch")

    def calls(config) -> list:
        return [lambda i=i: launch_tree_attention(q, keys[i % layers], values[i % layers], table_, prefix, meta,
                                                  D**-0.5, None, None, out, config)
                for i in range(GRAPH_REPEATS)]
    return calls, out, ref


def attention_config_sweep(device, args) -> list[str]:
    """Split-kernel parameters at B = 1, prefix 32k, and at the engine's tree (65 nodes)
    over a 1k prefix; the tables then use the fastest of each row-tile height over all
    rows (``attention.CUDA_TILES``). ``--smoke``: tiny shapes on CPU, to check the
    section itself."""
    if not args.sweep:
        return []
    import triton_ops.tree_attention.attention as attention_module
    from triton_ops.tree_attention.attention import KernelConfig, split_count

    gen = torch.Generator().manual_seed(22)
    Hq, Hkv, D, long_prefix = (6, 2, 32, 300) if args.smoke else (24, 4, 256, 32768)
    G = Hq // Hkv
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    rows, totals = [], {}
    for N, prefix_len in ((32, long_prefix), (64, long_prefix), (65, long_prefix), (128, long_prefix),
                          (65, long_prefix // 32)):
        case_calls, out, ref = attention_sweep_case(gen, N, prefix_len, Hq, Hkv, D, device, args.smoke)
        for height, candidates in ATTENTION_CANDIDATES.items():
            for tiles in candidates:
                block_m, block_n, warps, stages, per_sm, slack = tiles
                splits = split_count(-(-N * G // block_m) * Hkv, num_sms * per_sm)
                row = [str(N), str(prefix_len), "x".join(f"{x:g}" for x in tiles), str(splits)]
                config = KernelConfig(block_m, block_n, warps, stages, 2 * block_n, splits, per_sm, slack)
                calls = case_calls(config)
                try:
                    out.fill_(math.nan)
                    kernel = calls[0]()
                except Exception as exc:  # noqa: BLE001 - a config may not fit in shared memory
                    print(f"attention sweep {tiles}: {type(exc).__name__}: {exc}"[:400], flush=True)
                    rows.append([*row, "-", type(exc).__name__, "-"])
                    totals[tiles] = math.nan
                    continue
                err = rel_err(out, ref)
                if not err < 1e-2:
                    args.failed.append(f"attention sweep {tiles} N={N} prefix {prefix_len}")
                us = time_graph(calls, device)
                build = (f"{kernel.n_regs}/{kernel.n_spills}/{kernel.metadata.shared // 1024}K"
                         if device.type == "cuda" else "-")
                totals[tiles] = totals.get(tiles, 0.0) + us
                rows.append([*row, fmt(us), build, fmt_err(err)])
        del case_calls, out, ref  # the caches
    chosen = []
    for height, candidates in ATTENTION_CANDIDATES.items():
        finite = [t for t in candidates if math.isfinite(totals.get(t, math.nan))]
        if finite:
            attention_module.CUDA_TILES[height] = min(finite, key=totals.__getitem__)
        chosen.append("x".join(f"{x:g}" for x in attention_module.CUDA_TILES[height]))
    return table(f"tree attention split-kernel parameters, B=1 (us, graph; m x n x warps x "
                 f"stages x programs per SM x rescale slack; the tables use {', '.join(chosen)})",
                 ["N", "prefix", "parameters", "splits", "graph", "regs/spills/smem", "error vs torch fp32"], rows)


def kv_commit_table(device, args, bandwidth: float) -> list[str]:
    layers, Hkv, D = (2, 2, 32) if args.smoke else (16, 4, 256)
    gen = torch.Generator().manual_seed(23)
    rows = []
    for B in (1, 8):
        N = 64
        # Path 0, 1, 3, 5, ..., 29 (even nodes hang off the root): nodes 3..29 move.
        parents = torch.full((B, N), -1, dtype=torch.int32)
        parents[:, 1::2] = torch.arange(-1, N - 2, 2, dtype=torch.int32).clamp(min=0)
        parents[:, 2::2] = 0
        meta = build_tree_metadata(parents.to(device), None, 4)
        keys, values, table_ = paged_cache(gen, [4096 + N] * B, Hkv, D, 16, torch.bfloat16, "contiguous",
                                           device, layers)
        prefix = torch.full((B,), 4096, dtype=torch.int32, device=device)
        leaf = torch.full((B,), 29, device=device)
        run = lambda: tree_kv_commit(keys, values, table_, prefix, meta, leaf)  # noqa: E731
        floor = B * 14 * layers * Hkv * D * 2 * 2 * 2 / bandwidth * 1e6
        rows.append([str(B), fmt(time_eager(run, device)), fmt(time_graph([run] * GRAPH_REPEATS, device)),
                     fmt(floor, 2)])
    return table(f"tree KV commit, {layers} attention layers, {Hkv} kv heads, D={D}, bf16, 14 moved rows "
                 "per request (us)", ["B", "eager", "graph", "bytes floor"], rows)


# Fewest prefix keys a split takes, as multiples of the key tile (the default: 2). Each active
# split writes an fp32 partial of the tree's rows that the merge reads back: at a 1k prefix
# and 65 nodes, 8 splits move ~13 MB of partials against 4 MB of K/V.
MIN_CHUNK_TILES = (2, 4, 8, 16, 32)


def attention_min_chunk_sweep(device, args) -> list[str]:
    """The whole attention op (split + merge) at the engine's tree (N = 65, B = 1) by the
    split kernel's ``min_chunk`` at prefixes 1k, 8k, 32k, each output checked against the
    PyTorch path in fp32 first. ``--smoke``: tiny shapes on CPU, the checks alone."""
    if not args.sweep:
        return []
    gen = torch.Generator().manual_seed(23)
    Hq, Hkv, D, N = (6, 2, 32, 17) if args.smoke else (24, 4, 256, 65)
    rows = []
    for prefix_len in ((40, 300) if args.smoke else (1024, 8192, 32768)):
        case_calls, out, ref = attention_sweep_case(gen, N, prefix_len, Hq, Hkv, D, device, args.smoke)
        default = kernel_config(out, Hkv)
        for tiles in MIN_CHUNK_TILES:
            config = dataclasses.replace(default, min_chunk=tiles * default.block_n)
            # As the split kernel cuts the prefix: whole key tiles, at least min_chunk keys.
            per_split = -(-prefix_len // config.num_splits)
            chunk = max(-(-per_split // config.block_n) * config.block_n, config.min_chunk)
            active = -(-prefix_len // chunk)
            label = f"attention min_chunk {config.min_chunk} prefix {prefix_len}"
            rows.append([str(prefix_len), str(config.min_chunk), str(active),
                         *checked_graph_time(label, case_calls(config), out, ref, device, args)[1:]])
        del case_calls, out, ref  # the caches
    return table(f"tree attention by the split kernel's min_chunk (N={N}, B=1, {Hq} q / {Hkv} kv heads, D={D}; "
                 f"us, graph, split + merge; active splits of the default's {default.num_splits})",
                 ["prefix", "min_chunk", "active splits", "error vs torch fp32", "graph"], rows)


def checked_graph_time(label, calls, out, ref, device, args) -> tuple[float, str, str]:
    """Run ``calls[0]`` into a poisoned ``out`` and check it against ``ref`` (a failure
    joins ``args.failed`` and is not timed), then time ``calls`` under a CUDA graph:
    (us or NaN, error, time) with the last two formatted for a table."""
    out.fill_(math.nan)
    calls[0]()
    err = rel_err(out, ref)
    if not err < 1e-2:
        args.failed.append(label)
        return math.nan, fmt_err(err), "FAILED"
    us = guarded(label, lambda: time_graph(calls, device))
    return us, fmt_err(err), fmt(us)


# Value columns per merge program (attention.MERGE_COLUMNS): 256 is one program per row block
# (the kernel before stop 40), each halving doubles the programs.
MERGE_COLUMN_CANDIDATES = (256, 128, 64, 32)


def attention_merge_sweep(device, args) -> list[str]:
    """The whole attention op (split + merge) at the engine's tree (N = 65, B = 1) by the
    merge kernel's value columns per program at prefixes 1k and 32k, each output checked
    against the PyTorch path in fp32 first; the tables then use the fastest over both
    prefixes. ``--smoke``: tiny shapes on CPU, the checks alone."""
    if not args.sweep:
        return []
    import triton_ops.tree_attention.attention as attention_module

    gen = torch.Generator().manual_seed(24)
    Hq, Hkv, D, N = (6, 2, 96, 17) if args.smoke else (24, 4, 256, 65)
    rows, totals, default = [], dict.fromkeys(MERGE_COLUMN_CANDIDATES, 0.0), attention_module.MERGE_COLUMNS
    for prefix_len in ((40, 300) if args.smoke else (1024, 32768)):
        case_calls, out, ref = attention_sweep_case(gen, N, prefix_len, Hq, Hkv, D, device, args.smoke)
        config = kernel_config(out, Hkv)
        for columns in MERGE_COLUMN_CANDIDATES:
            attention_module.MERGE_COLUMNS = columns
            row_blocks = -(-N * (Hq // Hkv) // attention_module.MERGE_ROWS)
            programs = row_blocks * -(-D // columns) * Hkv
            us, *cells = checked_graph_time(f"attention merge columns {columns} prefix {prefix_len}",
                                            case_calls(config), out, ref, device, args)
            totals[columns] += us
            rows.append([str(prefix_len), str(columns), str(programs), *cells])
        del case_calls, out, ref  # the caches
    finite = [c for c in MERGE_COLUMN_CANDIDATES if math.isfinite(totals[c])]
    attention_module.MERGE_COLUMNS = min(finite, key=totals.__getitem__) if finite else default
    return table(f"tree attention by the merge kernel's value columns per program (N={N}, B=1, {Hq} q / {Hkv} "
                 f"kv heads, D={D}; us, graph, split + merge; the tables use "
                 f"{attention_module.MERGE_COLUMNS})",
                 ["prefix", "columns", "merge programs", "error vs torch fp32", "graph"], rows)


ATTN_SECTIONS = ("correctness", "sweep", "min-chunk", "merge", "timing", "kv-commit")


def bench_attention(args) -> list[str]:
    device = args.device
    deadline = time.monotonic() + args.budget_s
    args.attention_rows = None
    sections = {
        "correctness": lambda: attention_correctness(device, args.smoke, args.failed),
        "sweep": lambda: attention_config_sweep(device, args),
        "min-chunk": lambda: attention_min_chunk_sweep(device, args),
        "merge": lambda: attention_merge_sweep(device, args),
        "timing": lambda: [*attention_timing_table(device, args, copy_bandwidth(device), matmul_rate(device),
                                                   deadline),
                           *(markdown_table(*args.attention_rows) if args.attention_rows else [])],
        "kv-commit": lambda: kv_commit_table(device, args, copy_bandwidth(device)),
    }
    assert tuple(sections) == ATTN_SECTIONS
    return run_sections("attn", [sections[name] for name in args.attn_sections], args)


# --- sampled verifiers -----------------------------------------------------------------------


def sampled_tree_batch(gen, B, budget, depth, pool, vocab, device) -> DraftTree:
    """B sampled trees of ``budget`` nodes from random pools (the engine's T = 1 trees)."""
    pool_ids = torch.stack([torch.randperm(vocab, generator=gen)[:pool] for _ in range(B * depth)])
    pool_ids = pool_ids.view(B, depth, pool)
    logits = torch.randn(B, depth, pool, generator=gen) * 2
    seeds = torch.randint(0, 1 << 40, (B,), generator=gen)
    tree = build_sampled_tree(pool_ids[:, 0, 0], pool_ids, logits, budget, seeds)
    return dataclasses.replace(tree, **{f.name: getattr(tree, f.name).to(device)
                                        for f in dataclasses.fields(tree)
                                        if isinstance(getattr(tree, f.name), torch.Tensor)})


def verify_table(device, args) -> list[str]:
    """Per batch: both backends' plans agree (float64), their walks match, then eager time
    per call of each verifier on a budget-64 tree (sampled: traversal; the same tree as a
    deterministic one: target-only; greedy, whose paths both backends must agree on)."""
    vocab, depth, pool, budget = 4096 if args.smoke else 248320, 15, 512, 64
    gen = torch.Generator().manual_seed(31)
    rows = []
    for B in ((1, 2) if args.smoke else (1, 8, 32)):
        sampled = sampled_tree_batch(gen, B, budget, depth, pool, vocab, device)
        plain = dataclasses.replace(sampled, pool_ids=None, proposal_logq=None)
        probs = torch.softmax(3 * torch.randn(B, sampled.max_nodes, vocab, generator=gen).to(device), -1)
        seeds = torch.randint(0, 1 << 40, (B,), generator=gen).to(device)
        torch_plan = traversal_plan(sampled, probs, backend="torch")
        triton_plan = traversal_plan(sampled, probs, backend="triton")
        err = max((getattr(torch_plan, f) - getattr(triton_plan, f)).abs().max().item()
                  for f in ("alpha", "accept", "choice", "residual", "outside_scale"))
        uniforms = torch.rand(B, sampled.max_nodes, generator=gen, dtype=torch.float64).to(device)
        bonus = torch.rand(B, generator=gen, dtype=torch.float64).to(device)
        walks = [walk_plan(sampled, torch_plan, probs, uniforms, bonus, backend).output_tokens
                 for backend in ("torch", "triton")]
        same_walk = torch.equal(*walks)
        if not (err < 1e-12 and same_walk):
            args.failed.append(f"verify B={B}: plan error {err:.1e}, walks equal {same_walk}")
        cells = []
        for run in (lambda b: verify_traversal(sampled, probs, seeds, validate=False, backend=b),
                    lambda b: verify_target_only(plain, probs, seeds, validate=False, backend=b)):
            for backend in ("torch", "triton"):
                us = guarded(f"verify {backend}", lambda b=backend: time_eager(lambda: run(b), device))
                cells.append(f"{fmt(us)} ({launches(lambda b=backend: run(b))})")
        greedy = [verify_greedy(sampled, probs, False, backend).output_tokens
                  for backend in ("torch", "triton")]
        if not torch.equal(*greedy):
            args.failed.append(f"verify B={B}: greedy paths differ between the backends")
        for backend in ("torch", "triton"):
            run = lambda b=backend: verify_greedy(sampled, probs, False, b)  # noqa: E731
            cells.append(f"{fmt(time_eager(run, device))} ({launches(run)})")
        rows.append([str(B), str(sampled.max_nodes), *cells, fmt_err(err),
                     "yes" if same_walk else "NO"])
    return table(f"sampled verifiers, eager us per call (launches) (vocabulary {vocab}, sampled trees "
                 f"of {budget} drafted nodes from {pool}-id pools; target-only on the same trees as "
                 "deterministic ones; launches: vllm_tfm/benchmarks/launches.py); plan error: "
                 "max |PyTorch - kernels| over the traversal plan",
                 ["B", "N", "traversal torch", "traversal kernels", "target-only torch",
                  "target-only kernels", "greedy torch", "greedy kernel", "plan error",
                  "walks equal"], rows)


def bench_verify(args) -> list[str]:
    return run_sections("verify", [lambda: verify_table(args.device, args)], args)


# --- the target's linear layers by token count -------------------------------------------


def target_linears(config: dict) -> list[tuple[str, int, int, int]]:
    """(name, in features, out features, layers per forward) of a qwen3_5_text config's
    matrix products (attention with its output gate, as Qwen3.5 / 3.6 have)."""
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    attention_layers = layers // config["full_attention_interval"]
    gdn_layers = layers - attention_layers
    key = config["linear_num_key_heads"] * config["linear_key_head_dim"]
    value = config["linear_num_value_heads"] * config["linear_value_head_dim"]
    query = config["num_attention_heads"] * config["head_dim"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    return [
        ("gdn qkvz", hidden, 2 * key + 2 * value, gdn_layers),
        ("gdn ba", hidden, 2 * config["linear_num_value_heads"], gdn_layers),
        ("gdn out", value, hidden, gdn_layers),
        ("attn qkv", hidden, 2 * query + 2 * kv, attention_layers),
        ("attn o", query, hidden, attention_layers),
        ("mlp gate_up", hidden, 2 * config["intermediate_size"], layers),
        ("mlp down", config["intermediate_size"], hidden, layers),
        ("lm head", hidden, config["vocab_size"], 1),
    ]


def layer_weights(fan_in: int, fan_out: int, device) -> list[torch.Tensor]:
    """bf16 weights of as many layers of one linear as overflow L2 twice."""
    return [torch.randn(fan_out, fan_in, device=device, dtype=torch.bfloat16)
            for _ in range(layers_for(2 * fan_in * fan_out))]


def time_linear(x: torch.Tensor, weights: list[torch.Tensor], device, label: str) -> float:
    """Microseconds of F.linear(x, w) (the call vLLM's unquantized layers and the Weaver
    make), graph-replayed over ``weights``, one layer after another."""
    fns = [lambda w=w: torch.nn.functional.linear(x, w) for w in weights]
    fns *= max(1, GRAPH_REPEATS // len(fns))
    return guarded(label, lambda: time_graph(fns, device))


def gemm_table(device, args) -> list[str]:
    """Each linear layer of Qwen3.6-27B at M tokens (F.linear, the call vLLM's unquantized
    layers make), and their sum over one target forward: what M - 1 tree nodes cost in the
    dense part of the step against one decode token."""
    from vllm_tfm.training.bench_training import QWEN36_27B_TARGET

    config = dict(QWEN36_27B_TARGET)
    if args.smoke:
        config.update(hidden_size=64, intermediate_size=96, num_hidden_layers=4, vocab_size=512,
                      head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16)
    linears = target_linears(config)
    tokens = args.gemm_tokens
    gen = torch.Generator().manual_seed(14)
    widest = max(fan_in for _, fan_in, _, _ in linears)
    x_all = torch.randn(max(tokens), widest, generator=gen).to(device, torch.bfloat16)
    # F.linear against float64 at each M: a broken path must not time well.
    checks, failed = [], []
    w = (torch.randn(96, widest, generator=gen) / widest**0.5).to(device, torch.bfloat16)
    for M in tokens:
        x = x_all[:M]
        check_row(checks, failed, f"F.linear bf16, M={M}",
                  rel_err(torch.nn.functional.linear(x, w).double(), x.double() @ w.double().t()), 1e-2)
    args.failed += failed
    times = {}
    for name, fan_in, fan_out, _ in linears:
        weights = layer_weights(fan_in, fan_out, device)
        for M in tokens:
            times[name, M] = time_linear(x_all[:M, :fan_in], weights, device, f"{name} M={M}")
        del weights
    forward = {M: sum(times[name, M] * count for name, _, _, count in linears) / 1e3 for M in tokens}
    rows = [[str(M), *(fmt(times[name, M]) for name, *_ in linears), fmt(forward[M], 2),
             fmt(forward[M] / forward[tokens[0]], 2)] for M in tokens]
    return [*table("F.linear correctness (relative error against float64)", ["case", "error", "tol", ""], checks),
            *table(f"Qwen3.6-27B's linear layers by token count M (us per layer, graph; forward = "
                   f"their sum over {config['num_hidden_layers']} layers and the LM head, ms; ratio to "
                   f"M = {tokens[0]})", ["M", *(name for name, *_ in linears), "forward ms", "ratio"], rows)]


def weaver_gemm_table(device, args, bandwidth: float) -> list[str]:
    """The published Weaver's linear layers (``QWEN36_WEAVER_ARGS``, one block) at the rows
    of one expansion call, M = B requests x the default expand width 4: each call streams
    the four weights once for a handful of rows, so it should cost their bytes. Sixteen
    such calls make a budget-64 round (F.linear, the call the Weaver makes)."""
    from vllm_tfm.training import train_weaver
    from vllm_tfm.training.bench_training import QWEN36_WEAVER_ARGS

    shape = train_weaver.parse_args(["--out", "-", "--features", "-", *QWEN36_WEAVER_ARGS])
    d, mlp = (64, 48) if args.smoke else (shape.d_rank, shape.mlp_dim)
    linears = [("qkv", d, 3 * d), ("o", d, d), ("gate_up", d, 2 * mlp), ("down", mlp, d)]
    tokens = (4, 32, 128)
    x_all = torch.randn(max(tokens), d, generator=torch.Generator().manual_seed(15)).to(device, torch.bfloat16)
    times = {}
    for name, fan_in, fan_out in linears:
        weights = layer_weights(fan_in, fan_out, device)
        for M in tokens:
            times[name, M] = time_linear(x_all[:M, :fan_in], weights, device, f"weaver {name} M={M}")
        del weights
    floors = [2 * fan_in * fan_out / bandwidth * 1e6 for _, fan_in, fan_out in linears]
    rows = []
    for M in tokens:
        call = [times[name, M] for name, *_ in linears]
        rows.append([str(M), *(f"{fmt(t)} / {fmt(f, 2)}" for t, f in zip(call, floors)),
                     fmt(sum(call)), fmt(sum(call) / sum(floors), 2)])
    return table(f"Weaver's linear layers at M rows of one expansion call (d_rank {d}, mlp {mlp}; us, "
                 "graph / bytes floor)", ["M", *(name for name, *_ in linears), "call", "call / floor"], rows)


def bench_gemm(args) -> list[str]:
    return run_sections("gemm", [lambda: gemm_table(args.device, args),
                                 lambda: weaver_gemm_table(args.device, args, copy_bandwidth(args.device))], args)


# --- driver -----------------------------------------------------------------------------------


def run_sections(family: str, sections: list, args) -> list[str]:
    """Run each section, print its lines as it finishes; one broken section (a compiler
    error, say) is reported and must not hide the others' tables."""
    lines = []
    for section in sections:
        try:
            part = section()
        except Exception as exc:  # noqa: BLE001 - reported, counted as a failure
            part = [f"{family}: section failed: {type(exc).__name__}: {exc}"[:400], ""]
            args.failed.append(f"{family} section")
        print("\n".join(part), flush=True)
        lines += part
    return lines


FAMILIES = {"gdn": bench_gdn, "conv": bench_conv, "attn": bench_attention, "verify": bench_verify,
            "gemm": bench_gemm}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=",".join(FAMILIES), help=f"comma list of {sorted(FAMILIES)}")
    parser.add_argument("--out", type=Path, help="also write the tables to this file")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (TRITON_INTERPRET=1)")
    parser.add_argument("--sweep", action="store_true", help="add the launch-configuration sweeps")
    parser.add_argument("--skip-baselines", action="store_true",
                        help="skip the baselines (GDN: per-node-state, fla, vLLM; attention: SDPA)")
    parser.add_argument("--profile-gdn", action="store_true",
                        help="only launch the GDN kernels at the key shapes (run it under ncu)")
    parser.add_argument("--profile-attn", action="store_true",
                        help="only launch the tree attention at the key shapes (run it under ncu)")
    parser.add_argument("--gdn-sections", default=",".join(GDN_SECTIONS),
                        help="GDN: comma list of the sections to run, in this order")
    parser.add_argument("--attn-sections", default=",".join(ATTN_SECTIONS),
                        help="attention: comma list of the sections to run, in this order (sweep, "
                             "min-chunk and merge also need --sweep)")
    parser.add_argument("--gdn-shapes", default="",
                        help="GDN timing table and verify sweep: only these NxB shapes, e.g. 65x1,17x8 "
                             "(default: the table N in 16..128, B in 1, 8, 32; the sweep 128x1,64x8,128x8,64x32)")
    parser.add_argument("--kernels", default="",
                        help=f"GDN timing table: also time these verify kernels, comma list of {VERIFY_KERNELS}")
    parser.add_argument("--sweep-kernel", default="default",
                        help=f"GDN sweep: the verify kernel whose launch configurations it times, one of "
                             f"{('default', *VERIFY_KERNELS)} (default: the dispatch by N and batch)")
    parser.add_argument("--variants", action="store_true",
                        help="end with every variant of our kernels compiled (cache key: argument "
                             "specialisation and constexprs; registers, spills), to compare with "
                             "the engine's (bench_speed --profile)")
    parser.add_argument("--gemm-tokens", type=int, nargs="+",
                        default=[1, 8, 16, 17, 32, 33, 48, 64, 65, 72, 80, 96, 128, 129, 136, 256, 520],
                        help="gemm: the token counts M (the first is the ratios' base)")
    parser.add_argument("--budget-s", type=float, default=360.0,
                        help="GDN, attention: stop starting new timings after this many seconds")
    args = parser.parse_args()
    only = [name for name in args.only.split(",") if name]
    unknown = sorted(set(only) - set(FAMILIES))
    if unknown:
        parser.error(f"--only: unknown families {unknown}; choose from {sorted(FAMILIES)}")
    if args.smoke and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("--smoke runs the kernels interpreted: set TRITON_INTERPRET=1")
    if not args.smoke and not torch.cuda.is_available():
        parser.error("no CUDA device: run on a GPU, or pass --smoke")
    for option, known in (("gdn_sections", GDN_SECTIONS), ("attn_sections", ATTN_SECTIONS)):
        names = [name for name in getattr(args, option).split(",") if name]
        unknown = sorted(set(names) - set(known))
        if unknown:
            parser.error(f"--{option.replace('_', '-')}: unknown {unknown}; choose from {list(known)}")
        setattr(args, option, names)
    args.kernels = [name for name in args.kernels.split(",") if name]
    try:
        args.gdn_shapes = [tuple(int(x) for x in item.split("x")) for item in args.gdn_shapes.split(",") if item]
    except ValueError:
        parser.error(f"--gdn-shapes: NxB items like 64x1,128x32, got {args.gdn_shapes!r}")
    if any(len(shape) != 2 or min(shape) < 1 for shape in args.gdn_shapes):
        parser.error(f"--gdn-shapes: NxB items with N, B >= 1, got {args.gdn_shapes}")
    if args.sweep_kernel not in ("default", *VERIFY_KERNELS):
        parser.error(f"--sweep-kernel: choose from {('default', *VERIFY_KERNELS)}, got {args.sweep_kernel!r}")
    if set(args.kernels) - set(VERIFY_KERNELS):
        parser.error(f"--kernels: choose from {VERIFY_KERNELS}, got {args.kernels}")
    args.device = torch.device("cpu" if args.smoke else "cuda")
    args.failed = []
    started = time.monotonic()
    lines = []
    if not args.smoke:
        import triton

        lines.append(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
        print(lines[-1], flush=True)
    if args.smoke and (args.profile_gdn or args.profile_attn):
        parser.error("--profile-gdn / --profile-attn launch model shapes: run them on the GPU, "
                     "without --smoke")
    if args.profile_gdn or args.profile_attn:
        only = []
    if args.profile_gdn:
        lines += gdn_launches_for_profiler(args.device, args.kernels)
    if args.profile_attn:
        lines += attention_launches_for_profiler(args.device)
    for name in only:
        lines += FAMILIES[name](args)
    if args.variants:
        variants = ["", "Triton variants compiled (ours):", *compiled_variants()]
        print("\n".join(variants), flush=True)
        lines += variants
    lines.append(f"total {time.monotonic() - started:.0f} s; "
                 + (f"CORRECTNESS FAILED: {args.failed}" if args.failed else "all checks ok"))
    print(lines[-1])
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")
    return 1 if args.failed else 0


if __name__ == "__main__":
    sys.exit(main())
