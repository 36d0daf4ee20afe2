"""Check and time the tree conv and tree attention kernels on a CUDA GPU.

    python tools/bench_tree_ops.py            # correctness check, then the timing tables
    python tools/bench_tree_ops.py --no-check # timings only
    python tools/bench_tree_ops.py --sweep    # sweep tiles first; the tables use the fastest

Correctness: the Triton kernels against the float64 references (small shapes) and
against the vectorised PyTorch paths (model shapes), in bf16/fp16/fp32 and in
engine-like cache layouts. Timings: medians of ``triton.testing.do_bench`` (L2
flushed before each run), plus CUDA-graph replay for the launch-bound ops. Floors:
bytes moved / measured copy bandwidth, and FLOPs / measured bf16 matmul rate.

It imports `triton_ops` from the installed package; where the package is not installed
(a bare GPU machine), put the repository root on the path: `PYTHONPATH=$PWD python ...`.
"""

from __future__ import annotations

import argparse
import math

import torch
import triton
import triton.testing

import triton_ops.tree_attention.attention as attention_module
import triton_ops.tree_conv.conv as conv_module
from triton_ops.testing import random_tree_metadata, rel_err, same_bits
from triton_ops.tree_attention import (
    naive_tree_attention,
    naive_tree_kv_commit,
    paged_tree_attention,
    tree_kv_commit,
)
from triton_ops.tree_attention.attention import KernelConfig, kernel_config, launch_tree_attention
from triton_ops.tree_conv import naive_tree_conv1d, naive_tree_conv1d_commit, tree_conv1d, tree_conv1d_commit
from triton_ops.tree_conv.conv import launch_tree_conv1d
from triton_ops.tree_metadata import build_tree_metadata

DEV = "cuda"
FAILURES: list[str] = []
TREES = torch.Generator().manual_seed(0)


def median_us(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3


def graph_us(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median") * 1e3


def copy_bandwidth() -> float:
    """Bytes/s of a device-to-device copy, counting bytes read and written."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    return 2 * src.numel() / (median_us(lambda: dst.copy_(src)) * 1e-6)


def matmul_rate() -> float:
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=DEV)
    return 2 * 8192**3 / (median_us(lambda: a @ a) * 1e-6)


def random_meta(B, N, num_nodes, conv_width=4):
    """Random trees on the GPU, every third request a forest."""
    shapes = ["forest" if b % 3 == 2 else "random" for b in range(B)]
    return random_tree_metadata(TREES, shapes, N, num_nodes, conv_width, device=DEV)


def report(name: str, err: float, tol: float) -> None:
    ok = math.isfinite(err) and err <= tol
    if not ok:
        FAILURES.append(name)
    print(f"  {'ok  ' if ok else 'FAIL'} {name}: rel err {err:.2e} (tol {tol:.0e})")


# ---------------------------------------------------------------------------- conv
def conv_inputs(B, N, C, W, dtype):
    x = torch.randn(B, N, C, device=DEV).to(dtype)
    weight = (torch.randn(C, W, device=DEV) / W).to(dtype)
    bias = torch.randn(C, device=DEV).to(dtype)
    # vLLM keeps the conv state dim-last: [slots, W-1, C] viewed as [slots, C, W-1].
    state = torch.randn(B + 2, W - 1, C, device=DEV).to(dtype).transpose(1, 2)
    slots = torch.randperm(B + 2, device=DEV)[:B].to(torch.int32)
    return x, weight, bias, state, slots


def check_conv() -> None:
    print("tree conv1d vs float64 reference")
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2), (torch.float16, 1e-2)):
        for W in (2, 4):
            B, N, C = 3, 40, 1000
            meta = random_meta(B, N, [40, 17, 1], W)
            x, weight, bias, state, slots = conv_inputs(B, N, C, W, dtype)
            y = tree_conv1d(x, weight, bias, state, slots, meta)
            cpu = [t.cpu() for t in (x, weight, bias, state, slots)]
            ref = naive_tree_conv1d(*cpu, meta_cpu(meta))
            report(f"conv {dtype} W={W}", rel_err(y, ref), tol)
            leaf = torch.tensor([39, 5, -1], device=DEV)
            new_state = state.clone()
            tree_conv1d_commit(new_state, slots, x, meta, leaf)
            expected = naive_tree_conv1d_commit(cpu[3], cpu[4], cpu[0], meta_cpu(meta), leaf.cpu())
            report(f"conv commit {dtype} W={W} (bit-exact)", 0.0 if same_bits(new_state, expected) else math.inf, 0)


def meta_cpu(meta):
    return type(meta)(**{k: v.cpu() for k, v in vars(meta).items()})


def bench_conv(bandwidth: float) -> None:
    print("\n(a) tree conv, C=10240, W=4, bf16 (us; floor = bytes / copy bandwidth)")
    print(f"{'B':>3} {'N':>4} | {'conv':>7} {'graph':>7} {'floor':>6} | {'commit':>7} {'graph':>7}")
    for B in (1, 8, 32):
        for N in (16, 32, 64, 128):
            meta = random_meta(B, N, [N] * B)
            x, weight, bias, state, slots = conv_inputs(B, N, 10240, 4, torch.bfloat16)
            out = torch.empty_like(x)
            leaf = torch.full((B,), N - 1, device=DEV)
            conv = lambda: tree_conv1d(x, weight, bias, state, slots, meta, out=out)  # noqa: E731
            commit = lambda: tree_conv1d_commit(state, slots, x, meta, leaf)  # noqa: E731
            floor = (2 * x.numel() * 2 + B * 3 * 10240 * 2) / bandwidth * 1e6
            print(f"{B:>3} {N:>4} | {median_us(conv):7.1f} {graph_us(conv):7.1f} {floor:6.1f} | "
                  f"{median_us(commit):7.1f} {graph_us(commit):7.1f}")


def sweep_conv_tiles(C: int = 10240) -> None:
    print(f"\nconv tile sweep, C={C}, W=4, bf16 (us, graph replay): block_n x block_c / warps")
    configs = [(16, 256, 4), (32, 256, 4), (64, 256, 8), (8, 512, 4), (16, 512, 4), (32, 512, 8),
               (16, 1024, 8), (64, 128, 4)]
    print(f"{'B':>3} {'N':>4} | " + " ".join(f"{f'{n}x{c}/{w}':>10}" for n, c, w in configs))
    totals = [0.0] * len(configs)
    for B, N in ((1, 64), (8, 64), (32, 128)):
        meta = random_meta(B, N, [N] * B)
        x, weight, bias, state, slots = conv_inputs(B, N, C, 4, torch.bfloat16)
        out = torch.empty_like(x)
        times = []
        for block_n, block_c, warps in configs:
            times.append(graph_us(lambda: launch_tree_conv1d(  # noqa: B023
                x, weight, bias, state, slots, meta, "silu", out, block_n, block_c, warps)))
        print(f"{B:>3} {N:>4} | " + " ".join(f"{t:10.1f}" for t in times))
        totals = [total + t for total, t in zip(totals, times)]
    best = configs[min(range(len(configs)), key=totals.__getitem__)]
    conv_module.CUDA_TILES = best
    print(f"conv tables below use {best} (fastest summed over these shapes)")


# ----------------------------------------------------------------------- attention
def paged_cache(lengths, Hkv, D, block_size, dtype, layout, num_layers=1):
    """Caches in an engine layout with random K/V at each request's [0, length)."""
    need = [-(-n // block_size) for n in lengths]
    num_blocks = sum(need) + 2
    if layout == "kv_stacked":  # FlashInfer-like [blocks, 2, bs, H, D]
        both = torch.empty(num_layers, num_blocks, 2, block_size, Hkv, D, dtype=dtype, device=DEV)
        keys, values = both[:, :, 0], both[:, :, 1]
    elif layout == "hnd":  # [blocks, H, bs, D] seen as [blocks, bs, H, D]
        keys = torch.empty(num_layers, num_blocks, Hkv, block_size, D, dtype=dtype, device=DEV).transpose(2, 3)
        values = torch.empty(num_layers, num_blocks, Hkv, block_size, D, dtype=dtype, device=DEV).transpose(2, 3)
    else:
        keys = torch.empty(num_layers, num_blocks, block_size, Hkv, D, dtype=dtype, device=DEV)
        values = torch.empty_like(keys)
    keys.normal_()
    values.normal_()
    table = torch.zeros(len(lengths), max(need), dtype=torch.int32)
    perm = torch.randperm(num_blocks)
    for b, n in enumerate(need):
        table[b, :n], perm = perm[:n], perm[n:]
    return list(keys.unbind(0)), list(values.unbind(0)), table.to(DEV)


def check_attention() -> None:
    print("tree attention vs float64 reference (small) and the PyTorch path (model shapes)")
    small = [  # dtype, D, Hkv, G, prefixes, block size, layout, window, soft cap, tol
        (torch.bfloat16, 256, 2, 3, (0, 300), 16, "hnd", None, None, 1e-2),
        (torch.float16, 128, 1, 2, (1, 517), 32, "kv_stacked", None, 30.0, 1e-2),
        (torch.bfloat16, 64, 2, 1, (77, 260), 16, "contiguous", 40, None, 1e-2),
        (torch.float32, 128, 2, 3, (5, 400), 16, "contiguous", None, None, 1e-5),
    ]
    for dtype, D, Hkv, G, prefixes, bs, layout, window, cap, tol in small:
        N = 20
        meta = random_meta(2, N, [N, 11])
        keys, values, table = paged_cache([p + N for p in prefixes], Hkv, D, bs, dtype, layout)
        q = torch.randn(2, N, Hkv * G, D, device=DEV).to(dtype)
        prefix = torch.tensor(prefixes, dtype=torch.int32, device=DEV)
        out = paged_tree_attention(q, keys[0], values[0], table, prefix, meta, D**-0.5, window, cap)
        ref = naive_tree_attention(q.cpu(), keys[0].cpu(), values[0].cpu(), table.cpu(), prefix.cpu(),
                                   meta_cpu(meta), D**-0.5, window, cap)
        report(f"attention {dtype} D={D} G={G} {layout} window={window} cap={cap}", rel_err(out, ref), tol)
    for prefixes, N, window in (((1000, 4097), 64, None), ((8000, 3), 128, 1024)):
        meta = random_meta(2, N, [N, N // 2])
        keys, values, table = paged_cache([p + N for p in prefixes], 4, 256, 16, torch.bfloat16, "hnd")
        q = torch.randn(2, N, 24, 256, device=DEV).to(torch.bfloat16)
        prefix = torch.tensor(prefixes, dtype=torch.int32, device=DEV)
        out = paged_tree_attention(q, keys[0], values[0], table, prefix, meta, 256**-0.5, window)
        ref = paged_tree_attention(q.float(), keys[0].float(), values[0].float(), table, prefix,
                                   meta, 256**-0.5, window, backend="torch")
        report(f"attention Qwen shapes prefixes={prefixes} N={N} window={window} vs torch fp32",
               rel_err(out, ref), 1e-2)
    print("tree KV commit vs naive (bit-exact)")
    for layout in ("contiguous", "kv_stacked", "hnd"):
        N = 64
        meta = random_meta(3, N, [N, 30, 1])
        prefixes = (100, 7, 0)
        keys, values, table = paged_cache([p + N for p in prefixes], 4, 256, 16, torch.bfloat16, layout,
                                          num_layers=4)
        prefix = torch.tensor(prefixes, dtype=torch.int32, device=DEV)
        leaf = torch.tensor([N - 1, 29, 0], device=DEV)
        ref_k, ref_v = [k.cpu() for k in keys], [v.cpu() for v in values]
        naive_tree_kv_commit(ref_k, ref_v, table.cpu(), prefix.cpu(), meta_cpu(meta), leaf.cpu())
        tree_kv_commit(keys, values, table, prefix, meta, leaf)
        ok = all(same_bits(a, b) for a, b in zip(keys + values, ref_k + ref_v))
        report(f"kv commit {layout}", 0.0 if ok else math.inf, 0)


def sdpa_inputs(q, keys, values, table, prefixes, meta, N):
    """Contiguous [B, Hq, L, D] K/V (GQA expanded) and the dense bool mask SDPA needs."""
    B, _, Hq, D = q.shape
    L = max(prefixes) + N
    pos = torch.arange(L, device=DEV)
    blk = table.long()[:, (pos // keys.shape[1]).clamp(max=table.shape[1] - 1)]
    group = Hq // keys.shape[2]
    k = keys[blk, pos % keys.shape[1]].transpose(1, 2).repeat_interleave(group, 1)
    v = values[blk, pos % keys.shape[1]].transpose(1, 2).repeat_interleave(group, 1)
    prefix = torch.tensor(prefixes, device=DEV).view(B, 1, 1)
    rel = pos.view(1, 1, L) - prefix
    tree = torch.gather(meta.ancestors, 2, rel.clamp(0, N - 1).expand(B, N, L))
    mask = (rel < 0) | (tree & (rel < N))
    return q.transpose(1, 2), k, v, mask.unsqueeze(1)


def bench_attention(bandwidth: float, flops: float, with_sdpa: bool) -> None:
    print("\n(b) tree attention, 24 q / 4 kv heads, D=256, bf16, block 16, HND cache (us)")
    print("    bytes floor = K/V read once / copy bandwidth; flops floor = 4*B*Hq*N*L*D / bf16 matmul rate")
    print(f"{'B':>2} {'N':>4} {'prefix':>6} | {'ours':>7} {'graph':>7} {'sdpa':>8} {'bytes':>6} "
          f"{'flops':>6} | {'ours/bytes':>10} {'ours/max':>8} {'sdpa/ours':>9}")
    for B in (1, 8):
        for prefix_len in (1024, 8192, 32768):
            keys, values, table = paged_cache([prefix_len + 128] * B, 4, 256, 16, torch.bfloat16, "hnd")
            prefixes = [prefix_len] * B
            prefix = torch.tensor(prefixes, dtype=torch.int32, device=DEV)
            for N in (16, 64, 128):
                meta = random_meta(B, N, [N] * B)
                q = torch.randn(B, N, 24, 256, device=DEV, dtype=torch.bfloat16)
                out = torch.empty_like(q)
                run = lambda: paged_tree_attention(  # noqa: E731
                    q, keys[0], values[0], table, prefix, meta, 1 / 16, out=out)
                ours, ours_graph = median_us(run), graph_us(run)
                sdpa = math.nan
                if with_sdpa:
                    sq, sk, sv, mask = sdpa_inputs(q, keys[0], values[0], table, prefixes, meta, N)
                    sdpa = median_us(lambda: torch.nn.functional.scaled_dot_product_attention(
                        sq, sk, sv, attn_mask=mask, scale=1 / 16))
                    del sq, sk, sv, mask
                L = prefix_len + N
                bytes_floor = B * L * 4 * 256 * 2 * 2 / bandwidth * 1e6
                flops_floor = 4 * B * 24 * N * L * 256 / flops * 1e6
                print(f"{B:>2} {N:>4} {prefix_len:>6} | {ours:7.1f} {ours_graph:7.1f} {sdpa:8.1f} "
                      f"{bytes_floor:6.1f} {flops_floor:6.1f} | {ours / bytes_floor:10.2f} "
                      f"{ours / max(bytes_floor, flops_floor):8.2f} {sdpa / ours:9.2f}")
            del keys, values


def sweep_attention_configs(prefix_len: int = 32768, N: int = 64) -> None:
    print(f"\ntile sweep at B=1, N={N}, prefix {prefix_len} (us); default:", end=" ")
    meta = random_meta(1, N, [N])
    keys, values, table = paged_cache([prefix_len + N], 4, 256, 16, torch.bfloat16, "hnd")
    q = torch.randn(1, N, 24, 256, device=DEV, dtype=torch.bfloat16)
    prefix = torch.tensor([prefix_len], dtype=torch.int32, device=DEV)
    out = torch.empty_like(q)
    default = kernel_config(q, 4)
    default_tiles = attention_module.CUDA_TILES
    print(default)
    ref = paged_tree_attention(q, keys[0], values[0], table, prefix, meta, 1 / 16)
    candidates = [(64, 32, 4, 3), (64, 32, 4, 2), (64, 16, 4, 3), (64, 16, 8, 3), (64, 32, 8, 2),
                  (64, 32, 8, 3), (128, 16, 8, 3), (128, 32, 8, 2)]
    timings = {}
    for index, tiles in enumerate(candidates):
        attention_module.CUDA_TILES = tiles
        block_m, block_n, warps, stages = tiles
        for split_factor in (1, 2) if index == 0 else (1,):
            splits = kernel_config(q, 4).num_splits * split_factor
            config = KernelConfig(block_m, block_n, warps, stages, 4 * block_n, splits)
            run = lambda: launch_tree_attention(q, keys[0], values[0], table, prefix, meta,  # noqa: E731
                                                1 / 16, None, None, out, config)
            name = f"m{block_m} n{block_n} w{warps} s{stages} splits{splits}"
            try:
                kernel = run()
                err = rel_err(out, ref)
                elapsed = graph_us(run)
                if split_factor == 1:
                    timings[tiles] = elapsed
                build = "" if kernel is None else (  # the interpreter returns no handle
                    f"regs {kernel.n_regs}, spills {kernel.n_spills}, "
                    f"cp.async {kernel.asm['ptx'].count('cp.async')}, ")
                print(f"  {name}: {elapsed:7.1f} us graph ({build}rel diff to default {err:.1e})")
            except Exception as exc:  # a config may not fit in shared memory
                print(f"  {name}: {type(exc).__name__}: {str(exc)[:60]}")
    best = min(timings, key=timings.__getitem__) if timings else default_tiles
    attention_module.CUDA_TILES = best
    print(f"attention tables below use {best} (fastest here)")


def bench_kv_commit(bandwidth: float) -> None:
    print("\n(c) tree KV commit, 16 layers, 4 kv heads, D=256, bf16, 14 moved rows per request (us)")
    print(f"{'B':>2} | {'eager':>7} {'graph':>7} {'floor':>6}")
    for B in (1, 8):
        N = 64
        # Path 0, 1, 3, 5, ..., 29 (even nodes hang off the root): nodes 3..29 move.
        parents = torch.full((B, N), -1, dtype=torch.int32)
        parents[:, 1::2] = torch.arange(-1, N - 2, 2, dtype=torch.int32).clamp(min=0)
        parents[:, 2::2] = 0
        meta = build_tree_metadata(parents.to(DEV), None, 4)
        keys, values, table = paged_cache([4096 + N] * B, 4, 256, 16, torch.bfloat16, "contiguous", 16)
        prefix = torch.full((B,), 4096, dtype=torch.int32, device=DEV)
        leaf = torch.full((B,), 29, device=DEV)
        run = lambda: tree_kv_commit(keys, values, table, prefix, meta, leaf)  # noqa: E731
        floor = B * 14 * 32 * 1024 * 2 * 2 / bandwidth * 1e6
        print(f"{B:>2} | {median_us(run):7.1f} {graph_us(run):7.1f} {floor:6.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-check", action="store_true", help="skip the correctness check")
    parser.add_argument("--no-sdpa", action="store_true", help="skip the SDPA baseline")
    parser.add_argument("--sweep", action="store_true",
                        help="sweep conv and attention tiles first; the tables then use the fastest")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_tree_ops needs a CUDA GPU")
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    torch.manual_seed(0)
    bandwidth, flops = copy_bandwidth(), matmul_rate()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s, bf16 matmul {flops / 1e12:.0f} TFLOP/s")
    sections = []
    if not args.no_check:
        sections += [check_conv, check_attention]
    if args.sweep:
        sections += [sweep_conv_tiles, sweep_attention_configs]
    sections += [lambda: bench_conv(bandwidth), lambda: bench_kv_commit(bandwidth),
                 lambda: bench_attention(bandwidth, flops, with_sdpa=not args.no_sdpa)]
    for section in sections:
        # One broken section (a compiler error, say) must not hide the others' tables.
        try:
            section()
        except Exception as exc:
            FAILURES.append(f"{getattr(section, '__name__', 'section')}: {type(exc).__name__}")
            print(f"  FAIL {type(exc).__name__}: {str(exc)[:300]}")
    print(f"\nresult: {'all ok' if not FAILURES else 'FAILED: ' + ', '.join(FAILURES)}")
    if FAILURES:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
