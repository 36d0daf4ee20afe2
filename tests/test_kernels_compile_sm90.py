"""Every Triton kernel of ``triton_ops`` through Triton's compiler and ptxas for sm_90
(the H200), on this CPU machine, with this machine's Triton and with the device image's
(``tools/setup_env.sh`` installs it beside the venv: a kernel that compiled under one and
not the other would first fail on the device).

The interpreter runs a kernel as Python and never compiles it, so what only the compiler
refuses (a module global read inside ``@triton.jit``, a type that a GPU-only branch gets
wrong) first failed on the device (stop 19: a whole engine call lost). Here each op is
called once as the engine calls it on CUDA: GPU dtypes, and the GPU path's choices
(``interpreting()`` reads False in the op modules). Its launches are recorded instead of
run, and each is compiled with the argument types and constexprs it was launched with.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_tree_attention import make_paged_batch

import triton_ops.gdn_tree.chunk_triton as chunk_triton
import triton_ops.tree_metadata as tree_metadata
from triton_ops.counter_random import counter_gumbel, counter_uniform
from triton_ops.gdn_tree.chunk import DEFAULT_PRECISION, gdn_tree_commit, gdn_tree_commit_layers
from triton_ops.gdn_tree.fused_recurrent import fused_recurrent_gdn_tree
from triton_ops.gdn_tree.gating import gdn_gating
from triton_ops.pool_logits import pool_logits_log_softmax
from triton_ops.testing import (
    compile_sm90,
    compiled_variants,
    device_triton,
    random_tree_batch,
    random_tree_metadata,
    recording_launches,
    triton_kernels,
)
from triton_ops.tree_attention import paged_tree_attention, tree_kv_commit
from triton_ops.traversal import greedy_walk, traversal_law, walk_choices
from triton_ops.tree_conv import tree_conv1d, tree_conv1d_commit, tree_conv1d_commit_layers
from triton_ops.weaver_step.activation import silu_mul
from triton_ops.weaver_step.attention import node_attention
from triton_ops.weaver_step.frontier import (
    ExpandBatch,
    Frontier,
    GrowingTree,
    pop_frontier,
    push_children,
)
from triton_ops.weaver_step.node_paths import extend_paths
from triton_ops.weaver_step.norm import add_rms_norm, rms_norm

# The Triton of the device image (/work/.library/device/KINDS.md: triton 3.6.0), installed
# by tools/setup_env.sh beside the venv, and this machine's.
DEVICE_TRITON_VERSION = "3.6.0"
COMPILERS = ("local", "device")


def gdn_inputs(gen, B=2, N=65, H=2, HV=4, K=128):
    q, k = (torch.randn(B, N, H, K, generator=gen).bfloat16() for _ in range(2))
    v = torch.randn(B, N, HV, K, generator=gen).bfloat16()
    g = -torch.rand(B, N, HV, generator=gen)
    beta = torch.rand(B, N, HV, generator=gen)
    pool = torch.randn(3, HV, K, K, generator=gen)  # vLLM's [slots, HV, V, K]
    meta = random_tree_metadata(gen, ["bushy"] * B, N)
    return q, k, v, g, beta, pool.transpose(-1, -2), torch.tensor([2, 0]), meta


def verify_kernel(kernel):
    def call(gen):
        q, k, v, g, beta, state, slots, meta = gdn_inputs(gen)
        out = chunk_triton.verify_triton(q, k, v, g, beta, state, slots, meta, 128 ** -0.5,
                                         True, DEFAULT_PRECISION, kernel=kernel)
        if kernel == "tile":  # the commit consumes a verify's output: one layer, then two
            leaf = torch.tensor([3, -1])
            gdn_tree_commit(state, slots, meta, out, leaf, backend="triton")
            gdn_tree_commit_layers([state, state], [slots, slots], meta, [out, out], leaf,
                                   backend="triton")
    return call


def metadata(gen):
    parents, num_nodes = random_tree_batch(gen, ["random", "chain"], 65)
    meta = tree_metadata.build_tree_metadata(parents, num_nodes, backend="triton")
    token_rows = torch.arange(2 * 65).view(2, 65)
    tree_metadata.path_first_order(meta, torch.zeros(2, dtype=torch.int64), token_rows, 130,
                                   backend="triton")


def recurrent(gen):
    q, k, v, g, beta, state, slots, meta = gdn_inputs(gen, N=17)
    fused_recurrent_gdn_tree(q, k, v, g, beta, state, slots, meta)


def gating(gen):
    # a and b as the engine hands them over: strided columns of one bf16 projection.
    ba = torch.randn(2, 17, 96, generator=gen).bfloat16()
    gdn_gating(ba[..., :48], ba[..., 48:], torch.randn(48), torch.randn(48).bfloat16(),
               backend="triton")


def conv(gen):
    B, N, C, W = 2, 17, 256, 4
    meta = random_tree_metadata(gen, ["bushy"] * B, N)
    x = torch.randn(B, N, 2 * C, generator=gen).bfloat16()[:, :, ::2]
    weight, bias = torch.randn(C, W).bfloat16(), torch.randn(C).bfloat16()
    state = torch.randn(3, W - 1, C).bfloat16().transpose(1, 2)
    slots = torch.tensor([1, 2], dtype=torch.int32)
    tree_conv1d(x, weight, bias, state, slots, meta, activation="silu", backend="triton")
    tree_conv1d(x, weight, bias, state, slots, meta, activation="silu", backend="triton",
                inputs_out=torch.empty_like(x))  # the engine's dense steps: a copy of x too
    tree_conv1d_commit(state, slots, x, meta, torch.tensor([5, 0]), backend="triton")
    tree_conv1d_commit_layers([state, state], [slots, slots], [x, x], meta, torch.tensor([5, 0]),
                              backend="triton")


def attention(gen):
    num_nodes, prefix = (17, 9), (40, 3)
    meta = random_tree_metadata(gen, ["bushy", "chain"], 17, num_nodes)
    keys, values, table, _ = make_paged_batch(prefix, num_nodes, 2, 256, 16, "kv_stacked",
                                              torch.bfloat16, gen)
    q = torch.randn(2, 17, 12, 256, generator=gen).bfloat16()
    prefix_lens = torch.tensor(prefix, dtype=torch.int32)
    paged_tree_attention(q, keys[0], values[0], table, prefix_lens, meta, 256 ** -0.5,
                         backend="triton")
    tree_kv_commit(keys, values, table, prefix_lens, meta, torch.tensor([4, 8]),
                   backend="triton")


def pool(gen):
    y = torch.randn(2, 4, 64, generator=gen)
    table = torch.randn(100, 64, generator=gen).bfloat16()
    ids = torch.randint(0, 100, (2, 4, 32), generator=gen)
    pool_logits_log_softmax(y, table, ids, torch.randn(2, 4, 32, generator=gen),
                            backend="triton")


def weaver_step(gen):
    R, C, w, P, D = 2, 24, 4, 32, 5
    x = torch.randn(R * w, 64, generator=gen).bfloat16()
    rms_norm(x, torch.randn(64), torch.randn(64), 1e-6, backend="triton")
    add_rms_norm(x, x, torch.randn(64), torch.randn(64), 1e-6, backend="triton")
    silu_mul(x, backend="triton")
    ints = (lambda high: torch.randint(0, high, (R, C), generator=gen))
    frontier = Frontier(torch.randn(R, C, generator=gen), ints(50), ints(5), ints(4),
                        torch.randn(R, C, generator=gen))
    tree = GrowingTree(*(torch.zeros(R, 9, dtype=dtype) for dtype in
                         (torch.int64, torch.int64, torch.int64, torch.float32)),
                       torch.ones(R, dtype=torch.int64))
    pop_frontier(frontier, tree, w, D, backend="triton")
    node = torch.randint(-1, 6, (R, w), generator=gen)
    batch = ExpandBatch(node, node, node, torch.randint(0, D, (R, w), generator=gen),
                        torch.randn(R, w))
    push_children(frontier, 2, torch.randn(R, w, P, generator=gen), batch,
                  torch.randint(0, 100, (R, D, P), generator=gen), 4, backend="triton")
    paths = torch.full((R, 9, D + 1), -1, dtype=torch.int64)
    extend_paths(paths, torch.zeros(R, 9, dtype=torch.int64), node, node, node,
                 torch.ones(R, w, dtype=torch.int64), backend="triton")
    q, k, v = (torch.randn(R, w, 4, 64, generator=gen).bfloat16() for _ in range(3))
    prefix = [torch.randn(R, 7, 4, 64, generator=gen).bfloat16() for _ in range(2)]
    nodes = [torch.randn(R, 12, 4, 64, generator=gen).bfloat16() for _ in range(2)]
    kv_slot = torch.arange(w).expand(R, w).contiguous()
    ancestors = torch.full((R, w, 6), -1, dtype=torch.int64)
    node_attention(q, k, v, *prefix, *nodes, kv_slot, ancestors, None, None,
                   backend="triton")


def counter_random(gen):
    seeds = torch.randint(0, 1 << 40, (2,), generator=gen)
    counters = torch.arange(2 * 600).view(2, 600)
    counter_uniform(seeds, 3, counters, backend="triton")
    counter_gumbel(seeds, 1, counters, backend="triton")


def traversal(gen):
    R, N, S = 2, 17, 512
    index = torch.randint(-1, N, (R, N), generator=gen)
    children = torch.randint(-1, N, (R, N, N - 1), generator=gen)
    target = torch.rand(R, N, S, generator=gen, dtype=torch.float64)
    law = traversal_law(index, index, children, index, target, target[..., 0], target, 16,
                        backend="triton")
    walk_choices(law.choice, children, target[..., 0], 16, backend="triton")
    picks = torch.randint(0, S, (R, N), generator=gen)
    greedy_walk(picks, index, picks, torch.full((R,), N), 16, backend="triton")


CASES = {
    **{f"gdn verify {kernel}": verify_kernel(kernel)
       for kernel in chunk_triton.VERIFY_KERNELS},
    "tree metadata": metadata, "gdn recurrent": recurrent, "gdn gating": gating,
    "tree conv": conv, "traversal": traversal, "counter random": counter_random,
    "tree attention": attention, "pool logits": pool, "weaver step": weaver_step,
}


def recorded_launches(case: str, gen) -> list:
    """(kernel function, args, kwargs) of every launch ``case`` makes, none of them run."""
    with recording_launches() as launches:
        CASES[case](gen)
    return launches


def test_the_cases_launch_every_kernel(gen):
    kernels = {name.split(":")[1] for name in triton_kernels()}
    assert len(kernels) == len(triton_kernels()) > 20  # every kernel, each name once
    launched = {fn.__name__ for case in CASES for fn, _, _ in recorded_launches(case, gen)}
    assert kernels == launched


def test_compiled_variants_list_each_kernels_cache_entries():
    """What bench_speed --profile and bench_kernels --variants print: a line per compiled
    variant (Triton's per-device cache of a JITFunction: kernel cache first), with
    registers and spills once the kernel was loaded; nothing for interpreted kernels."""
    loaded = SimpleNamespace(n_regs=168, n_spills=0)
    jit = SimpleNamespace(device_caches={0: ({"key-a": loaded, "key-b": object()}, {}, None, None, None)})
    assert compiled_variants({"m:_a_kernel": jit}) == [
        "m:_a_kernel (device 0, n_regs 168, n_spills 0): key-a", "m:_a_kernel (device 0): key-b"]
    assert compiled_variants() == []  # interpreted here: nothing compiled


@pytest.mark.parametrize("compiler", sorted(COMPILERS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_every_launch_compiles_for_sm90(case, compiler, gen):
    launches = recorded_launches(case, gen)
    assert launches, f"{case} launched no kernel"
    compile_sm90(launches, device_triton() if compiler == "device" else None)


def test_the_device_compiler_is_the_device_images_triton():
    assert (device_triton() / f"triton-{DEVICE_TRITON_VERSION}.dist-info").is_dir(), \
        f"{device_triton()} lacks Triton {DEVICE_TRITON_VERSION}: run tools/setup_env.sh"


def test_a_compile_report_counts_the_kernels_code(gen):
    """What tools/compiled_kernels.py prints: the verify's registers, stack and SASS, and
    the source lines with most instructions, all of them in triton_ops."""
    launches = recorded_launches("gdn verify peeled_tile", gen)
    (report,) = compile_sm90(launches[:1], lines=5)
    assert report["kernel"] == "_verify_tile_kernel" and 0 < report["registers"] <= 255
    assert report["instructions"] > 1000 and report["stack"] >= 0
    assert report["local_loads"] <= report["instructions"]
    assert report["mma_waits"] > 0 and report["barriers"] > 0  # its dots run as wgmma on sm_90
    assert len(report["lines"]) == 5
    assert all(count > 0 for _, count in report["lines"])
    assert any(where.startswith("triton_ops/gdn_tree/chunk_triton.py:") for where, _ in report["lines"])


def test_a_commit_of_several_layers_loads_as_a_commit_of_one(gen, monkeypatch):
    """Each layer is layer 0's pointer plus an offset read at run time, so the compiler
    knows no alignment of it: without the table's alignment hint (layer_tensor) every
    vector load and store became a scalar one (the GDN commit at 65 nodes, K = V = 128:
    32 vector loads and 8 vector stores -> none). A commit of several layers keeps the
    single-layer commit's vector accesses."""
    def commits(gen):
        verify_kernel("tile")(gen)  # the GDN commit of one layer, then two
        conv(gen)  # the conv commit of one layer, then two
    monkeypatch.setitem(CASES, "commits", commits)
    launches = [launch for launch in recorded_launches("commits", gen)
                if "commit" in launch[0].__name__]
    by_kernel = {}
    for launch, report in zip(launches, compile_sm90(launches)):
        by_kernel.setdefault(launch[0].__name__, []).append((report["ld"], report["st"]))
    assert sorted(by_kernel) == ["_commit_kernel", "_tree_conv1d_commit_kernel"]
    for kernel, (one, several) in by_kernel.items():
        assert sum(one) > 0 and several == one, kernel


def test_compiled_kernels_tool_tables_each_launch(tmp_path):
    """tools/compiled_kernels.py end to end: one row per launch (the split makes two), with
    the source lines asked for, saved with --out; a launch the kernel does not take is named,
    not compiled."""
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "compiled.md"
    done = subprocess.run(
        [sys.executable, str(root / "tools" / "compiled_kernels.py"), "--shapes", "16x1,64x8,17x1",
         "--configs", "default,32x8", "--compiler", "local", "--lines", "3", "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=root, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in out.read_text().splitlines() if line.startswith("| 1") or line.startswith("| 6")]
    assert [row.split(" | ")[3] for row in rows] == ["_verify_tile_kernel"] * 2 + [
        "_verify_prepare_kernel", "_verify_output_kernel"] * 2 + ["_verify_tile_kernel"]
    assert "| 32 x 8 |" in rows[1] and out.read_text().count("chunk_triton.py:") >= 3
    assert "peeled_tile at 17 x 1 takes no 8 warps" in out.read_text()
    bad = subprocess.run([sys.executable, str(root / "tools" / "compiled_kernels.py"), "--shapes", "65"],
                         capture_output=True, text=True, cwd=root, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert bad.returncode == 2 and "--shapes must be comma-separated AxB pairs" in bad.stderr
