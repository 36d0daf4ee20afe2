"""Tree GDN verify/commit (torch path and Triton kernels) against the float64 per-node recurrence."""

import math
from collections import OrderedDict

import pytest
import torch
import triton
import triton.language as tl

from triton_ops.gdn_tree import (
    fused_recurrent_gdn_tree,
    gdn_tree_commit,
    gdn_tree_commit_layers,
    gdn_tree_verify,
    naive_recurrent_gdn_tree,
)
import triton_ops.utils as utils
from triton_ops.gdn_tree import chunk_triton
from triton_ops.gdn_tree.chunk import DEFAULT_PRECISION, PRECISIONS
from triton_ops.gdn_tree.naive import l2_normalize
from triton_ops.testing import random_tree_metadata, recording_launches, rel_err
from triton_ops.tree_metadata import build_tree_metadata
from triton_ops.utils import interpreting

FP32_TOL = 2e-5


def make_inputs(gen, B, N, H, HV, K, V, dtype=torch.float32, num_slots=None, gate_scale=2.0):
    num_slots = num_slots or B + 2
    q = torch.randn(B, N, H, K, generator=gen).to(dtype)
    k = torch.randn(B, N, H, K, generator=gen).to(dtype)
    v = torch.randn(B, N, HV, V, generator=gen).to(dtype)
    g = -gate_scale * torch.rand(B, N, HV, generator=gen)
    beta = torch.sigmoid(torch.randn(B, N, HV, generator=gen)).to(dtype)
    pool = 0.5 * torch.randn(num_slots, HV, K, V, generator=gen)
    slots = torch.randperm(num_slots, generator=gen)[:B].to(torch.int32)
    return q, k, v, g, beta, pool, slots


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """Every float tensor the kernels allocate starts as NaN: unwritten entries fail."""
    empty = torch.empty

    def nan_empty(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(chunk_triton.torch, "empty", nan_empty)


def check_verify(out, ref_o, meta, tol):
    assert rel_err(out.o, ref_o) < tol
    padding = ~meta.valid
    for t in (out.o, out.delta, out.gate_sum, out.k_normed):
        assert torch.isfinite(t).all()
        assert (t[padding] == 0).all()


# --- torch path: many shapes -------------------------------------------------------------

TORCH_CASES = [
    # B, N, H, HV, K, V, tree shapes
    (1, 1, 1, 1, 16, 16, ["random"]),
    (3, 40, 2, 4, 16, 32, ["random", "forest", "star"]),
    (2, 128, 1, 3, 32, 16, ["chain", "chain"]),
    (4, 128, 2, 2, 16, 16, ["random", "bushy", "forest", "star"]),
    (2, 65, 3, 9, 20, 24, ["bushy", "forest"]),
    (2, 64, 2, 4, 64, 64, ["random", "chain"]),
    (1, 64, 1, 2, 128, 128, ["bushy"]),
]


@pytest.mark.parametrize("case", TORCH_CASES, ids=lambda c: "x".join(map(str, c[:6])))
def test_torch_verify_and_commit_match_naive(case, gen):
    B, N, H, HV, K, V, shapes = case
    meta = random_tree_metadata(gen, shapes, N)
    q, k, v, g, beta, pool, slots = make_inputs(gen, B, N, H, HV, K, V)
    ref_o, ref_states = naive_recurrent_gdn_tree(q, k, v, g, beta, pool, slots, meta)
    out = gdn_tree_verify(q, k, v, g, beta, pool, slots, meta)
    check_verify(out, ref_o, meta, FP32_TOL)

    leaf = torch.stack([torch.randint(-1, int(n), (1,), generator=gen)[0] for n in meta.num_nodes])
    new_pool = pool.clone()
    gdn_tree_commit(new_pool, slots, meta, out, leaf)
    for b in range(B):
        slot = int(slots[b])
        if leaf[b] < 0:
            assert torch.equal(new_pool[slot], pool[slot])
        else:
            assert rel_err(new_pool[slot], ref_states[b, leaf[b]]) < FP32_TOL
    untouched = torch.ones(pool.shape[0], dtype=torch.bool)
    untouched[slots.long()] = False
    assert torch.equal(new_pool[untouched], pool[untouched])


def test_float64_inputs_are_exact(gen):
    meta = random_tree_metadata(gen, ["random", "chain", "forest"], 128)
    q, k, v, g, beta, pool, slots = make_inputs(gen, 3, 128, 2, 4, 16, 16)
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    ref_o, _ = naive_recurrent_gdn_tree(q, k, v, g, beta, pool, slots, meta)
    out = gdn_tree_verify(q, k, v, g, beta, pool, slots, meta)
    assert out.o.dtype == torch.float64 and rel_err(out.o, ref_o) < 1e-12


# --- Triton kernels (interpreted on CPU) ------------------------------------------------

TRITON_CASES = [
    (1, 1, 1, 1, 16, 16, ["random"]),
    (2, 5, 1, 2, 16, 16, ["random", "star"]),
    (3, 40, 2, 4, 16, 32, ["random", "forest", "star"]),
    (2, 17, 1, 3, 16, 16, ["chain", "forest"]),
    (2, 33, 1, 3, 20, 24, ["bushy", "chain"]),
    (1, 70, 1, 1, 16, 16, ["random"]),
    (2, 24, 2, 2, 64, 64, ["forest", "random"]),
    (1, 16, 1, 1, 128, 128, ["bushy"]),
    # Past one 64-row block: block forward substitution across row blocks.
    (2, 65, 1, 2, 16, 16, ["star", "chain"]),
    (2, 65, 2, 6, 32, 32, ["bushy", "forest"]),
    (1, 65, 1, 3, 128, 128, ["random"]),  # the engine's default tree at the model's head dims
    (2, 66, 1, 3, 16, 16, ["chain", "star"]),
    (2, 72, 2, 6, 16, 16, ["random", "forest"]),
    (2, 80, 1, 2, 16, 16, ["random", "bushy"]),
    (1, 81, 2, 2, 16, 16, ["forest"]),
    (1, 80, 1, 2, 128, 128, ["bushy"]),  # the model's head dims: two K chunks per pass
    (2, 96, 2, 4, 16, 16, ["forest", "bushy"]),
    (3, 100, 2, 6, 16, 32, ["bushy", "forest", "star"]),
    (1, 127, 1, 3, 24, 16, ["random"]),
    (2, 128, 1, 2, 32, 16, ["chain", "random"]),
    # Past the tile kernels: the split's 256-row workspace, 128 rows peeled (two blocks).
    (2, 129, 1, 3, 32, 32, ["chain", "star"]),
]


def kernels_for(N: int) -> list[str]:
    """The verify kernels that take N nodes (the tile kernels at most TILE_MAX_NODES)."""
    return [k for k in chunk_triton.VERIFY_KERNELS if chunk_triton.kernel_takes(k, N)]


def use_kernel(monkeypatch, kernel: str) -> None:
    """gdn_tree_verify's Triton path launches ``kernel`` instead of the default for N."""
    monkeypatch.setattr(chunk_triton, "default_verify_kernel", lambda N, heads: kernel)


@pytest.mark.parametrize(
    "case, kernel",
    [(c, k) for c in TRITON_CASES for k in kernels_for(c[1])],
    ids=lambda x: x if isinstance(x, str) else "x".join(map(str, x[:6])),
)
def test_triton_verify_and_commit_match_naive(case, kernel, poisoned_outputs, gen, monkeypatch):
    use_kernel(monkeypatch, kernel)
    B, N, H, HV, K, V, shapes = case
    meta = random_tree_metadata(gen, shapes, N)
    q, k, v, g, beta, pool, slots = make_inputs(gen, B, N, H, HV, K, V)
    ref_o, ref_states = naive_recurrent_gdn_tree(q, k, v, g, beta, pool, slots, meta)
    out = gdn_tree_verify(q, k, v, g, beta, pool, slots, meta, backend="triton")
    check_verify(out, ref_o, meta, FP32_TOL)
    torch_out = gdn_tree_verify(q, k, v, g, beta, pool, slots, meta, backend="torch")
    for name in ("delta", "gate_sum", "k_normed"):
        assert rel_err(getattr(out, name), getattr(torch_out, name).double()) < FP32_TOL, name

    leaf = torch.stack([torch.randint(-1, int(n), (1,), generator=gen)[0] for n in meta.num_nodes])
    leaf[0] = int(meta.num_nodes[0]) - 1
    new_pool = pool.clone()
    gdn_tree_commit(new_pool, slots, meta, out, leaf, backend="triton")
    for b in range(B):
        slot = int(slots[b])
        if leaf[b] < 0:
            assert torch.equal(new_pool[slot], pool[slot])
        else:
            assert rel_err(new_pool[slot], ref_states[b, leaf[b]]) < FP32_TOL
    untouched = torch.ones(pool.shape[0], dtype=torch.bool)
    untouched[slots.long()] = False
    assert torch.equal(new_pool[untouched], pool[untouched])


@pytest.mark.parametrize("N, kernel", [(N, kernel) for N in (129, 128, 80, 65) for kernel in kernels_for(N)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_mixed_counts_skip_padding_row_blocks(dtype, kernel, N, poisoned_outputs, gen, monkeypatch):
    """Requests of N, 65, 64, 17 and 1 nodes in one batch: some end inside the
    first row block, some one node into the second (64 rows at N = 128, 16 at N =
    80 for the tile kernel; none at N = 65 peeled), whose padding blocks the kernels skip
    (the peeled kernels' blocks start one node later: at N = 129 the peeled split's
    two 64-row blocks hold every node but the root); every real node
    still matches, every padding row is zero. With bf16 inputs the committed fp32
    state still holds fp32 accuracy (the state products split the state in bf16 parts)."""
    use_kernel(monkeypatch, kernel)
    counts = [N, 65, 64, 17, 1]
    B, H, HV, K, V = len(counts), 1, 3, 16, 16
    meta = random_tree_metadata(gen, ["bushy", "random", "chain", "forest", "star"], N, counts)
    q, k, v, g, beta, pool, slots = make_inputs(gen, B, N, H, HV, K, V, dtype=dtype)
    # Padding inputs hold NaN: no kernel may read them.
    for t in (q, k, v, g, beta):
        t[~meta.valid] = float("nan")
    ref_o, ref_states = naive_recurrent_gdn_tree(q, k, v, g, beta, pool, slots, meta)
    ref_o = torch.where(meta.valid[..., None, None], ref_o, 0.0)
    out = gdn_tree_verify(q, k, v, g, beta, pool, slots, meta, backend="triton")
    check_verify(out, ref_o, meta, FP32_TOL if dtype == torch.float32 else 1e-2)
    leaf = meta.num_nodes.long() - 1
    new_pool = pool.clone()
    gdn_tree_commit(new_pool, slots, meta, out, leaf, backend="triton")
    for b in range(B):
        assert rel_err(new_pool[int(slots[b])], ref_states[b, leaf[b]]) < FP32_TOL, counts[b]


@pytest.mark.parametrize("kernel", ["peeled_tile", "peeled_split"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k_chunk, fuse_parts", [(32, True), (128, True), (None, False)])
def test_launch_knobs_verify_alike(kernel, dtype, k_chunk, fuse_parts, poisoned_outputs, gen):
    """The engine's tree (65 nodes) at the model's head dims, its passes over K in chunks
    of 32 (four a pass) or 128 (one) instead of K_CHUNK, bf16 state parts in one dot or in
    three (the tile kernel's 64-row block); a bad chunk is refused."""
    meta = random_tree_metadata(gen, ["bushy"], 65)
    q, k, v, g, beta, pool, slots = make_inputs(gen, 1, 65, 1, 2, 128, 128, dtype=dtype)
    ref_o, ref_states = naive_recurrent_gdn_tree(q, k, v, g, beta, pool, slots, meta)
    out = chunk_triton.verify_triton(q, k, v, g, beta, pool, slots, meta, 128 ** -0.5, True,
                                     "tf32x3", kernel=kernel, k_chunk=k_chunk, fuse_parts=fuse_parts)
    check_verify(out, ref_o, meta, FP32_TOL if dtype == torch.float32 else 1e-2)
    # The committed state keeps fp32 accuracy whatever the inputs' dtype (the parts are exact).
    new_pool = pool.clone()
    gdn_tree_commit(new_pool, slots, meta, out, torch.tensor([64]), backend="triton")
    assert rel_err(new_pool[slots.long()], ref_states[:, 64]) < FP32_TOL
    with pytest.raises(ValueError, match="k_chunk must be a power of two >= 16, got 48"):
        chunk_triton.verify_triton(q, k, v, g, beta, pool, slots, meta, 128 ** -0.5, True,
                                   "tf32x3", kernel=kernel, k_chunk=48)


@pytest.mark.parametrize("num_warps, fused", [(None, True), (4, True), (8, False)])
def test_state_parts_fuse_only_at_four_warps(num_warps, fused, gen):
    """A tile launch with a 64-row block asks for the fused parts; only a 4-warp launch gets
    them (FUSED_PARTS_WARPS). Unpeeled: a peeled kernel takes no 8 warps."""
    meta = random_tree_metadata(gen, ["bushy"], 64)
    inputs = make_inputs(gen, 1, 64, 1, 2, 128, 128, dtype=torch.bfloat16)
    with recording_launches() as launches:
        chunk_triton.verify_triton(*inputs, meta, 128 ** -0.5, True, "tf32x3", kernel="tile",
                                   num_warps=num_warps, fuse_parts=True)
    [(kernel, _, kwargs)] = launches
    assert kernel.__name__ == "_verify_tile_kernel"
    assert kwargs["num_warps"] == (num_warps or 4)
    assert kwargs["FUSE_PARTS"] is fused


@pytest.mark.parametrize("seed", range(4))
def test_triton_kernels_on_random_shapes(seed, poisoned_outputs, monkeypatch):
    """Random sizes, grouping, dtypes, tree shapes and node counts, every verify
    kernel that takes them; the seed and shape are printed for a failing run."""
    gen = torch.Generator().manual_seed(1000 + seed)
    pick = lambda options: options[int(torch.randint(len(options), (1,), generator=gen))]  # noqa: E731
    B, H, group = pick([1, 2, 3]), pick([1, 2]), pick([1, 3])
    N = pick([1, 7, 16, 17, 31, 33, 50, 64, 65, 66, 72, 80, 90, 96, 127, 128])
    K, V, dtype = pick([16, 24, 32]), pick([16, 40]), pick([torch.float32, torch.bfloat16])
    counts = [N] + [int(torch.randint(1, N + 1, (1,), generator=gen)) for _ in range(B - 1)]
    shapes = [pick(["random", "bushy", "chain", "forest", "star"]) for _ in range(B)]
    print(f"seed {1000 + seed}: B={B} N={N} H={H} HV={H * group} K={K} V={V} {dtype} {shapes} {counts}")
    meta = random_tree_metadata(gen, shapes, N, counts)
    q, k, v, g, beta, pool, slots = make_inputs(gen, B, N, H, H * group, K, V, dtype=dtype)
    for t in (q, k, v, g, beta):
        t[~meta.valid] = float("nan")
    ref_o, ref_states = naive_recurrent_gdn_tree(q, k, v, g, beta, pool, slots, meta)
    ref_o = torch.where(meta.valid[..., None, None], ref_o, 0.0)
    leaf = meta.num_nodes.long() - 1
    for kernel in kernels_for(N):
        use_kernel(monkeypatch, kernel)
        out = gdn_tree_verify(q, k, v, g, beta, pool, slots, meta, backend="triton")
        check_verify(out, ref_o, meta, FP32_TOL if dtype == torch.float32 else 1e-2)
        new_pool = pool.clone()
        gdn_tree_commit(new_pool, slots, meta, out, leaf, backend="triton")
        assert torch.isfinite(new_pool).all(), kernel
        assert rel_err(new_pool[slots.long()], ref_states[torch.arange(B), leaf]) < FP32_TOL, kernel


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("N, counts", [(65, [65, 65]), (17, [17, 9])])
def test_verify_writes_o_into_out(backend, N, counts, gen):
    """``out`` (the engine's layer output rows, when they hold the nodes in order) becomes
    ``o``: written in place, every element (padding rows zero), equal to a run without it."""
    B, H, HV, K, V = len(counts), 1, 3, 16, 16
    meta = random_tree_metadata(gen, ["bushy", "random"], N, counts)
    inputs = make_inputs(gen, B, N, H, HV, K, V, dtype=torch.bfloat16)
    fresh = gdn_tree_verify(*inputs, meta, backend=backend)
    rows = torch.full((B * N + 5, HV, V), float("nan"), dtype=torch.bfloat16)
    out = rows[2 : 2 + B * N].view(B, N, HV, V)  # a contiguous slice of a larger buffer
    result = gdn_tree_verify(*inputs, meta, backend=backend, out=out)
    assert result.o.data_ptr() == out.data_ptr()
    assert torch.equal(out, fresh.o)
    assert rows[:2].isnan().all() and rows[2 + B * N :].isnan().all()  # nothing outside
    for name in ("delta", "gate_sum", "k_normed"):
        assert torch.equal(getattr(result, name), getattr(fresh, name)), name


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("N, counts", [(65, [65, 65]), (17, [17, 9]), (40, [40, 23])])
def test_verify_writes_the_commit_fields_where_allocate_says(backend, N, counts, gen):
    """``allocate`` (the engine's reused record buffers) gives the fields the commit reads:
    views of larger NaN-filled buffers, every element written (padding nodes too), equal
    to a run without it; the commit through them gives the same states."""
    B, H, HV, K, V = len(counts), 1, 3, 16, 16
    meta = random_tree_metadata(gen, ["bushy", "random"], N, counts)
    q, k, v, g, beta, pool, slots = make_inputs(gen, B, N, H, HV, K, V)
    fresh = gdn_tree_verify(q, k, v, g, beta, pool, slots, meta, backend=backend)
    flats, asked = {}, []

    def allocate(name, shape, dtype, device):
        asked.append(name)
        flats[name] = torch.full((math.prod(shape) + 7,), float("nan"), dtype=dtype, device=device)
        return flats[name][: math.prod(shape)].view(shape)

    result = gdn_tree_verify(q, k, v, g, beta, pool, slots, meta, backend=backend, allocate=allocate)
    assert sorted(asked) == ["delta", "gate_sum", "k_normed"]
    for name in asked:
        assert getattr(result, name).data_ptr() == flats[name].data_ptr(), name
        assert torch.equal(getattr(result, name), getattr(fresh, name)), name
        assert flats[name][-7:].isnan().all(), name  # nothing past the view
    assert torch.equal(result.o, fresh.o)
    leaf = torch.tensor([counts[0] - 1, counts[1] // 2])
    committed = pool.clone()
    gdn_tree_commit(committed, slots, meta, result.for_commit(), leaf, backend=backend)
    gdn_tree_commit(pool, slots, meta, fresh, leaf, backend=backend)
    assert torch.equal(committed, pool)
    with pytest.raises(ValueError, match="allocate's gate_sum must be .* torch.float64"):
        gdn_tree_verify(q, k, v, g, beta, pool, slots, meta, backend=backend,
                        allocate=lambda name, shape, dtype, device: torch.empty(shape))
    with pytest.raises(ValueError, match="allocate's delta must be contiguous"):
        gdn_tree_verify(q, k, v, g, beta, pool, slots, meta, backend=backend,
                        allocate=lambda name, shape, dtype, device:
                        torch.empty(shape[::-1], dtype=dtype).permute(*range(len(shape))[::-1]))


@triton.jit
def _bf16_parts_kernel(x_ptr, parts_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    hi, mid, lo = chunk_triton.bf16_parts(tl.load(x_ptr + offs), True)
    tl.store(parts_ptr + offs, hi.to(tl.float32))
    tl.store(parts_ptr + BLOCK + offs, mid.to(tl.float32))
    tl.store(parts_ptr + 2 * BLOCK + offs, lo.to(tl.float32))


def test_bf16_parts_keep_fp32_accuracy(gen):
    """hi + mid + lo of an fp32 state is within 2^-24 of it at every magnitude the
    state can hold, each part a bf16 value (the bf16 state-product path relies on both)."""
    x = torch.randn(1024, generator=gen) * torch.exp2(torch.randint(-60, 60, (1024,), generator=gen).float())
    x[:4] = torch.tensor([0.0, -0.0, 1.0, -3.0e38])
    device = "cpu" if interpreting() else "cuda"
    x = x.to(device)
    parts = torch.empty(3, 1024, device=device)
    _bf16_parts_kernel[(1,)](x, parts, BLOCK=1024)
    x, parts = x.cpu(), parts.cpu()
    for part in parts:
        assert torch.equal(part.to(torch.bfloat16).float(), part)
    total = parts.double().sum(0)
    assert ((total - x.double()).abs() <= 2.0**-24 * x.double().abs()).all()


def test_tile_second_block_rows():
    assert [chunk_triton.tile_second_block(n) for n in (1, 64, 65, 80, 81, 128)] == [0, 0, 16, 16, 64, 64]


def test_default_verify_kernel_weighs_nodes_and_batch():
    """A tile kernel up to 80 nodes while the batch is small, the split past either; each
    peeled where node 0 alone spills into a larger block (the engine's root + power-of-two
    budget trees)."""
    heads, large = chunk_triton.SPLIT_MIN_HEADS, chunk_triton.SPLIT_MIN_HEADS_LARGE
    assert chunk_triton.default_verify_kernel(16, 48) == "tile"
    assert chunk_triton.default_verify_kernel(64, 48) == "tile"
    for N in (17, 33, 65):  # budgets 16, 32, 64
        assert chunk_triton.default_verify_kernel(N, 48) == "peeled_tile", N
        assert chunk_triton.default_verify_kernel(N, heads) == "peeled_split", N
    assert chunk_triton.default_verify_kernel(66, 48) == "tile"  # 65 rows after the root: no block saved
    assert chunk_triton.default_verify_kernel(66, heads) == "split"
    assert chunk_triton.default_verify_kernel(80, large - 1) == "tile"
    assert chunk_triton.default_verify_kernel(81, 48) == "split"
    assert chunk_triton.default_verify_kernel(128, 48) == "split"
    assert chunk_triton.default_verify_kernel(129, 48) == "peeled_split"
    assert chunk_triton.default_verify_kernel(64, heads) == "split"
    # B = 8 at HV = 48: the split from 64 nodes, the tile kernel below (measured cells).
    assert chunk_triton.default_verify_kernel(17, large) == "peeled_tile"
    assert chunk_triton.default_verify_kernel(63, large) == "tile"
    assert chunk_triton.default_verify_kernel(64, large) == "split"
    assert chunk_triton.default_verify_kernel(65, large) == "peeled_split"
    assert chunk_triton.default_verify_kernel(65, large - 1) == "peeled_tile"


def test_peel_shrinks_split_at_a_root_and_a_power_of_two():
    shrinking = [N for N in range(1, 600) if chunk_triton.peel_shrinks_split(N)]
    assert shrinking == [17, 33, 65, 129, 257, 513]


def test_unknown_verify_kernel_raises(gen):
    meta = random_tree_metadata(gen, ["random"], 130)
    inputs = make_inputs(gen, 1, 130, 1, 1, 16, 16)
    for kernel, match in (("fast", "kernel must be one of"), ("tile", "tile kernels only for N <= 128"),
                          ("peeled_tile", "tile kernels only for N <= 128")):
        with pytest.raises(ValueError, match=match):
            chunk_triton.verify_triton(*inputs, meta, 0.25, True, "tf32x3", kernel=kernel)


@pytest.mark.parametrize("kernel", chunk_triton.PEELED_KERNELS)
def test_peeled_kernels_refuse_more_than_four_warps(kernel, gen):
    """8 warps read shared memory out of bounds in the peeled kernels under Triton 3.6
    (compute-sanitizer, H100): refused before any launch; 4 warps launch."""
    meta = random_tree_metadata(gen, ["bushy"], 17)
    inputs = make_inputs(gen, 1, 17, 1, 2, 32, 32)
    with recording_launches() as launches:
        with pytest.raises(ValueError, match=f"num_warps: kernel '{kernel}' takes at most 4 warps.*got 8"):
            chunk_triton.verify_triton(*inputs, meta, 0.25, True, "tf32x3", kernel=kernel, num_warps=8)
        assert launches == []
        chunk_triton.verify_triton(*inputs, meta, 0.25, True, "tf32x3", kernel=kernel, num_warps=4)
    assert launches[-1][2]["num_warps"] == 4  # the tile or output kernel, launched last
    assert chunk_triton.kernel_takes_warps("tile", 8) and chunk_triton.kernel_takes_warps("split", 8)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_commit_every_node_of_a_tree_equals_sequential_path(backend, gen):
    parents = torch.tensor([[-1, 0, 0, 1, 1, 2, 3, 3, 5, 6, 8, 2]])
    meta = build_tree_metadata(parents)
    N = parents.shape[1]
    q, k, v, g, beta, pool, slots = make_inputs(gen, 1, N, 1, 2, 16, 16, num_slots=3)
    out = gdn_tree_verify(q, k, v, g, beta, pool, slots, meta, backend=backend)
    for leaf in range(N):
        path = [leaf]
        while parents[0, path[-1]] >= 0:
            path.append(int(parents[0, path[-1]]))
        path = path[::-1]
        # The accepted path as an ordinary chain: its final state is the committed one.
        chain = build_tree_metadata(torch.arange(-1, len(path) - 1).view(1, -1))
        pick = torch.tensor(path)
        _, states = naive_recurrent_gdn_tree(
            q[:, pick], k[:, pick], v[:, pick], g[:, pick], beta[:, pick], pool, slots, chain
        )
        new_pool = pool.clone()
        gdn_tree_commit(new_pool, slots, meta, out, torch.tensor([leaf]), backend=backend)
        assert rel_err(new_pool[int(slots[0])], states[0, -1]) < FP32_TOL, path


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_nothing_accepted_leaves_pool_bit_identical(backend, gen):
    meta = random_tree_metadata(gen, ["random"] * 3, 20)
    q, k, v, g, beta, pool, slots = make_inputs(gen, 3, 20, 1, 2, 16, 16, num_slots=6)
    pool_bf16 = pool.to(torch.bfloat16)
    for p in (pool, pool_bf16):
        before = p.clone()
        out = gdn_tree_verify(q, k, v, g, beta, p, slots, meta, backend=backend)
        assert torch.equal(p, before)  # verify writes no state
        gdn_tree_commit(p, slots, meta, out, torch.full((3,), -1), backend=backend)
        as_bits = torch.int16 if p.element_size() == 2 else torch.int32
        assert torch.equal(p.view(as_bits), before.view(as_bits))


@pytest.mark.parametrize("N", [40, 65, 96])
@pytest.mark.parametrize(
    "backend, kernel", [("torch", None)] + [("triton", kernel) for kernel in chunk_triton.VERIFY_KERNELS]
)
def test_huge_gate_spread_stays_finite(backend, kernel, N, poisoned_outputs, gen, monkeypatch):
    if kernel is not None:
        use_kernel(monkeypatch, kernel)
    B = 2
    meta = random_tree_metadata(gen, ["bushy", "forest"], N)
    q, k, v, g, beta, pool, slots = make_inputs(gen, B, N, 1, 2, 16, 16)
    # Thousands of nats between neighbours: exp of a non-ancestor difference would overflow.
    g = -torch.rand(B, N, 2, generator=gen) * 3000.0
    g[:, ::3] = -1e-3
    ref_o, ref_states = naive_recurrent_gdn_tree(q, k, v, g, beta, pool, slots, meta)
    out = gdn_tree_verify(q, k, v, g, beta, pool, slots, meta, backend=backend)
    check_verify(out, ref_o, meta, FP32_TOL)
    leaf = meta.num_nodes.long() - 1
    new_pool = pool.clone()
    gdn_tree_commit(new_pool, slots, meta, out, leaf, backend=backend)
    for b in range(B):
        assert torch.isfinite(new_pool).all()
        assert rel_err(new_pool[int(slots[b])], ref_states[b, leaf[b]]) < FP32_TOL


@pytest.mark.parametrize("kernel", chunk_triton.VERIFY_KERNELS)
def test_node_0_reaches_only_its_own_tree(kernel, poisoned_outputs, gen, monkeypatch):
    """The peeled kernels add node 0's column under the ancestor mask, so a forest needs no
    other path: here node 0 is a lone root and a 64-node chain (the rows after it fill one
    block exactly) starts at node 1; node 0's decay of 3000 nats would overflow in any
    unmasked exp(G_i - G_0)."""
    use_kernel(monkeypatch, kernel)
    N = 65
    parents = torch.arange(-1, N - 1).view(1, N).expand(2, N).contiguous()
    parents[:, 1] = -1
    parents[1, 2:] = 0  # the second request: a star around node 0 for contrast
    meta = build_tree_metadata(parents)
    q, k, v, g, beta, pool, slots = make_inputs(gen, 2, N, 1, 3, 16, 16)
    g[:, 0] = -3000.0
    ref_o, ref_states = naive_recurrent_gdn_tree(q, k, v, g, beta, pool, slots, meta)
    out = gdn_tree_verify(q, k, v, g, beta, pool, slots, meta, backend="triton")
    check_verify(out, ref_o, meta, FP32_TOL)
    leaf = torch.tensor([N - 1, N - 1])
    new_pool = pool.clone()
    gdn_tree_commit(new_pool, slots, meta, out, leaf, backend="triton")
    assert rel_err(new_pool[slots.long()], ref_states[torch.arange(2), leaf]) < FP32_TOL


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_strided_inputs_and_vllm_pool_layout(backend, poisoned_outputs, gen):
    """q/k/v sliced out of one fused projection, the pool stored [slots, HV, V, K], bf16 state."""
    B, N, H, HV, K, V = 2, 24, 2, 4, 16, 32
    meta = random_tree_metadata(gen, ["random", "star"], N)
    fused = torch.randn(B, N, 2 * H * K + HV * V + 7, generator=gen)
    q = fused[..., : H * K].view(B, N, H, K)
    k = fused[..., H * K : 2 * H * K].view(B, N, H, K)
    v = fused[..., 2 * H * K : 2 * H * K + HV * V].view(B, N, HV, V)
    gb = torch.randn(B, N, 2 * HV, generator=gen)
    g = -torch.nn.functional.softplus(gb[..., :HV])
    beta = torch.sigmoid(gb[..., HV:])
    for dtype in (torch.float32, torch.bfloat16):
        pool_vk = (0.5 * torch.randn(5, HV, V, K, generator=gen)).to(dtype)
        pool = pool_vk.transpose(-1, -2)
        slots = torch.tensor([3, 1], dtype=torch.int64)
        ref_o, ref_states = naive_recurrent_gdn_tree(q, k, v, g, beta, pool, slots, meta)
        out = gdn_tree_verify(q, k, v, g, beta, pool, slots, meta, backend=backend)
        check_verify(out, ref_o, meta, FP32_TOL)
        leaf = meta.num_nodes.long() - 1
        gdn_tree_commit(pool, slots, meta, out, leaf, backend=backend)
        tol = FP32_TOL if dtype == torch.float32 else 1e-2
        for b in range(B):
            assert rel_err(pool_vk[int(slots[b])].transpose(-1, -2), ref_states[b, leaf[b]]) < tol


@pytest.mark.parametrize("precision", PRECISIONS)
def test_every_precision_runs_verify_and_commit(precision, gen):
    """The interpreter computes every dot in fp32 whatever ``precision`` says, so on
    CPU this checks what it can: each mode reaches both kernels, runs and stays
    fp32-accurate. The rounding that tells the modes apart is tested on CUDA below."""
    meta = random_tree_metadata(gen, ["random"], 20)
    q, k, v, g, beta, pool, slots = make_inputs(gen, 1, 20, 1, 1, 16, 16)
    ref_o, ref_states = naive_recurrent_gdn_tree(
        q, k, v, g, beta, pool, slots, meta, scale=0.3, use_qk_l2norm=False
    )
    out = gdn_tree_verify(
        q, k, v, g, beta, pool, slots, meta, 0.3, False, backend="triton", precision=precision
    )
    assert rel_err(out.o, ref_o) < FP32_TOL
    leaf = torch.tensor([19])
    gdn_tree_commit(pool, slots, meta, out, leaf, backend="triton", precision=precision)
    assert rel_err(pool[int(slots[0])], ref_states[0, 19]) < FP32_TOL


@pytest.mark.skipif(
    not torch.cuda.is_available() or interpreting(),
    reason="tf32 rounding exists only in kernels compiled for CUDA (run with TRITON_INTERPRET=0 "
    "on a GPU): the interpreter computes every dot in fp32",
)
def test_tf32_rounds_where_tf32x3_and_ieee_keep_fp32(gen):
    """PRECISIONS' claim at the model's head size: tf32 keeps 10 mantissa bits
    (~1e-3), tf32x3 and ieee stay at fp32 accuracy, in verify and in commit."""
    B, N, H, HV, K, V = 2, 64, 2, 4, 128, 128
    meta = random_tree_metadata(gen, ["bushy", "random"], N, [N, N], device="cuda")
    inputs = [t.cuda() for t in make_inputs(gen, B, N, H, HV, K, V)]
    ref_o, ref_states = naive_recurrent_gdn_tree(*inputs, meta)
    leaf = torch.full((B,), N - 1, device="cuda")
    verify_err, commit_err = {}, {}
    for precision in PRECISIONS:
        out = gdn_tree_verify(*inputs, meta, precision=precision)
        pool = inputs[5].clone()
        gdn_tree_commit(pool, inputs[6], meta, out, leaf, precision=precision)
        verify_err[precision] = rel_err(out.o, ref_o)
        commit_err[precision] = rel_err(pool[inputs[6].long()], ref_states[:, N - 1])
    print(f"relative error, verify: {verify_err}, commit: {commit_err}")
    for errs in (verify_err, commit_err):
        assert errs["tf32x3"] < FP32_TOL and errs["ieee"] < FP32_TOL, errs
        assert 10 * max(errs["tf32x3"], errs["ieee"]) < errs["tf32"] < 1e-2, errs


def test_fused_recurrent_baseline_matches_naive(gen):
    B, N, H, HV, K, V = 2, 20, 1, 3, 16, 24
    meta = random_tree_metadata(gen, ["random", "forest"], N)
    q, k, v, g, beta, pool, slots = make_inputs(gen, B, N, H, HV, K, V)
    ref_o, ref_states = naive_recurrent_gdn_tree(q, k, v, g, beta, pool, slots, meta)
    o, states = fused_recurrent_gdn_tree(q, k, v, g, beta, pool, slots, meta)
    assert rel_err(o, ref_o) < FP32_TOL
    assert (o[~meta.valid] == 0).all()
    assert rel_err(states[meta.valid], ref_states[meta.valid]) < FP32_TOL


# --- chains against fla ------------------------------------------------------------------


@pytest.fixture(scope="module")
def fla_gdn():
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
    from fla.ops.gated_delta_rule.naive import naive_chunk_gated_delta_rule

    return fused_recurrent_gated_delta_rule, naive_chunk_gated_delta_rule


def chain_meta(B, N):
    return build_tree_metadata(torch.arange(-1, N - 1).expand(B, N).contiguous())


def test_chain_matches_fla_recurrent(fla_gdn, gen):
    fused_recurrent, _ = fla_gdn
    B, N, H, HV, K, V = 2, 24, 1, 2, 16, 32
    q, k, v, g, beta, pool, slots = make_inputs(gen, B, N, H, HV, K, V)
    meta = chain_meta(B, N)
    s0 = pool[slots.long()]
    o_fla, s_fla = fused_recurrent(
        q, k, v, g=g, beta=beta, initial_state=s0.clone(), output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    ref_o, ref_states = naive_recurrent_gdn_tree(q, k, v, g, beta, pool, slots, meta)
    assert rel_err(o_fla, ref_o) < FP32_TOL
    assert rel_err(s_fla, ref_states[:, -1]) < FP32_TOL
    for backend in ("torch", "triton"):
        out = gdn_tree_verify(q, k, v, g, beta, pool, slots, meta, backend=backend)
        assert rel_err(out.o, o_fla.double()) < FP32_TOL
        new_pool = pool.clone()
        gdn_tree_commit(new_pool, slots, meta, out, torch.full((B,), N - 1), backend=backend)
        assert rel_err(new_pool[slots.long()], s_fla.double()) < FP32_TOL


def test_bf16_no_worse_than_fla_chain(fla_gdn, gen):
    """bf16 inputs and output: our error vs float64 stays within fla's chunk reference's."""
    _, naive_chunk = fla_gdn
    B, N, H, HV, K, V = 2, 64, 2, 4, 64, 64
    q, k, v, g, beta, pool, slots = make_inputs(gen, B, N, H, HV, K, V, dtype=torch.bfloat16)
    meta = chain_meta(B, N)
    ref_o, _ = naive_recurrent_gdn_tree(q, k, v, g, beta, pool, slots, meta)
    out = gdn_tree_verify(q, k, v, g, beta, pool, slots, meta)
    assert out.o.dtype == torch.bfloat16
    ours = rel_err(out.o, ref_o)
    group = HV // H
    o_fla, _ = naive_chunk(
        l2_normalize(q.float()).repeat_interleave(group, 2),
        l2_normalize(k.float()).repeat_interleave(group, 2),
        v, g, beta, initial_state=pool[slots.long()],
    )
    theirs = rel_err(o_fla.to(torch.bfloat16), ref_o)
    assert ours <= 1.05 * theirs + 1e-6, (ours, theirs)
    assert ours < 1e-2


# --- bad input ---------------------------------------------------------------------------


def test_bad_inputs_raise_value_error_naming_the_argument(gen, monkeypatch):
    B, N, H, HV, K, V = 2, 8, 1, 2, 16, 16
    meta = random_tree_metadata(gen, ["random"] * B, N)
    args = dict(zip(("q", "k", "v", "g", "beta", "ssm_state", "state_slots"), make_inputs(gen, B, N, H, HV, K, V)))
    args["meta"] = meta

    def expect(match, **change):
        with pytest.raises(ValueError, match=match):
            gdn_tree_verify(**{**args, **change})

    expect("q", q=args["q"][0])
    expect("k", k=args["k"][:, :, :, :8])
    expect("v", v=args["v"][:, :4])
    expect("HV", v=torch.randn(B, N, 3, V), g=torch.zeros(B, N, 3), beta=torch.zeros(B, N, 3))
    expect("k must have q's dtype", k=args["k"].double())
    expect("g", g=args["g"].double())
    expect("g", g=args["g"][:, :, :1])
    expect("beta", beta=args["beta"][:, :3])
    expect("ssm_state", ssm_state=args["ssm_state"][:, :, :8])
    expect("ssm_state", ssm_state=args["ssm_state"].half())
    expect("state_slots", state_slots=args["state_slots"].float())
    expect("state_slots", state_slots=torch.tensor([0, 99]))
    expect("meta", meta=build_tree_metadata(torch.tensor([[-1, 0]])))
    expect("meta", meta=meta.parents)
    expect("backend", backend="cuda")
    expect("precision", precision="fp16")
    expect("q must have", q=args["q"].double(), k=args["k"].double(), v=args["v"].double(),
           g=args["g"].double(), backend="triton")
    big = torch.randn(B, N, H, 257)
    expect("K=257", q=big, k=big, ssm_state=torch.zeros(4, HV, 257, V))
    expect(r"out must be \[B, N, HV, V\] = \[2, 8, 2, 16\]", out=torch.empty(B, N, HV, V + 1))
    expect("out must be .* torch.float32", out=torch.empty(B, N, HV, V, dtype=torch.bfloat16))
    expect("out must be contiguous", out=torch.empty(B, N, V, HV).transpose(-1, -2))
    with pytest.raises(ValueError, match="topolog"):
        build_tree_metadata(torch.tensor([[-1, 2, 0]]))
    with pytest.raises(ValueError, match="out of range"):
        build_tree_metadata(torch.tensor([[-1, -3, 0]]))

    out = gdn_tree_verify(**args)
    pool, slots = args["ssm_state"], args["state_slots"]
    with pytest.raises(ValueError, match="accepted_leaf"):
        gdn_tree_commit(pool, slots, meta, out, torch.tensor([0, int(meta.num_nodes[1])]))
    with pytest.raises(ValueError, match="accepted_leaf"):
        gdn_tree_commit(pool, slots, meta, out, torch.tensor([0]))
    with pytest.raises(ValueError, match="ssm_state"):
        gdn_tree_commit(pool[:, :1], slots, meta, out, torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="verify_out"):
        gdn_tree_commit(pool, slots, meta, out.o, torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="node_states"):
        fused_recurrent_gdn_tree(*make_inputs(gen, B, N, H, HV, K, V), meta, node_states=torch.empty(1))
    # Without the interpreter CPU tensors run no kernel: the shared error, not a launch failure.
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="backend='triton' needs CUDA tensors.*TRITON_INTERPRET=1"):
        gdn_tree_verify(**args, backend="triton")
    with pytest.raises(ValueError, match="backend='triton' needs CUDA tensors"):
        gdn_tree_commit(pool, slots, meta, out, torch.tensor([0, 0]), backend="triton")
    with pytest.raises(ValueError, match="backend='triton' needs CUDA tensors"):
        fused_recurrent_gdn_tree(*make_inputs(gen, B, N, H, HV, K, V), meta)


def test_default_scale_is_inverse_sqrt_k(gen):
    meta = random_tree_metadata(gen, ["random"], 6)
    inputs = make_inputs(gen, 1, 6, 1, 1, 16, 16)
    a = gdn_tree_verify(*inputs, meta)
    b = gdn_tree_verify(*inputs, meta, scale=1 / math.sqrt(16))
    assert torch.equal(a.o, b.o)


@pytest.mark.parametrize("N", [40, 65])
@pytest.mark.parametrize("block_k, block_v, warps", [(16, 32, 2), (32, 16, 2), (16, 16, 1)])
def test_commit_state_tiles_commit_the_same_states(N, block_k, block_v, warps, gen):
    """The commit's tuning knobs (bench_kernels' commit sweep) partition the state tile only:
    every tile gives the default's states, and the float64 path's within tolerance. Compiled,
    bit for bit (bench_kernels checks that on the GPU); here to a few fp32 ulps, since the
    interpreter's dots are NumPy matmuls whose OpenBLAS kernel, picked by CPU and shape, sets
    the summation order (on an AMD EPYC they differ in the last bits; a tile that dropped or
    repeated a block would be off by O(1))."""
    meta = random_tree_metadata(gen, ["bushy", "forest"], N)
    q, k, v, g, beta, pool, slots = make_inputs(gen, 2, N, 1, 2, 32, 32)
    out = gdn_tree_verify(q, k, v, g, beta, pool, slots, meta, backend="triton")
    leaf = meta.num_nodes.long() - 1
    default, tuned = pool.clone(), pool.clone()
    gdn_tree_commit(default, slots, meta, out, leaf, backend="triton")
    chunk_triton.commit_triton(tuned, slots, meta, out, leaf, DEFAULT_PRECISION, block_k=block_k,
                               block_v=block_v, num_warps=warps)
    assert not torch.equal(default, pool)
    torch.testing.assert_close(tuned, default, rtol=1e-6, atol=1e-6)
    _, states = naive_recurrent_gdn_tree(q, k, v, g, beta, pool, slots, meta)
    for b in range(2):
        assert rel_err(tuned[int(slots[b])], states[b, leaf[b]]) < FP32_TOL


def verified_layers(gen, meta, layers: int, num_slots: int, H: int, HV: int, K: int, V: int,
                    backend: str = "triton"):
    """(pools, slots, verify outputs) of ``layers`` GDN layers over ``meta``'s trees, each
    with inputs and slots of its own; the pools in vLLM's layout ([slots, HV, V, K] seen
    transposed), all but the last layer's views of one shared buffer, the last apart."""
    shared = torch.randn(layers - 1, num_slots, HV, V, K, generator=gen)
    apart = torch.randn(num_slots, HV, V, K, generator=gen)
    pools = [pool.transpose(-1, -2) for pool in (*shared, apart)]
    slots, outs = [], []
    B, N = meta.parents.shape
    for pool in pools:
        q, k, v, g, beta, _, layer_slots = make_inputs(gen, B, N, H, HV, K, V, num_slots=num_slots)
        slots.append(layer_slots)
        outs.append(gdn_tree_verify(q, k, v, g, beta, pool, layer_slots, meta, backend=backend))
    return pools, slots, outs


# N, tree shapes, K, V: several K and V blocks a layer (64 each), a ragged last V block.
LAYERS_CASES = [(17, ["bushy", "forest"], 128, 128), (40, ["chain", "star"], 32, 32),
                (65, ["random", "bushy"], 32, 80)]


@pytest.mark.parametrize("N, shapes, K, V", LAYERS_CASES, ids=lambda c: str(c))
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_commit_of_several_layers_commits_each_as_its_own_commit(N, shapes, K, V, backend, gen):
    """gdn_tree_commit_layers (one launch for a step's GDN layers, each with its own pool,
    slots and verify output) leaves every pool as that layer's own gdn_tree_commit does,
    bit for bit, including the slots of requests that accepted nothing and every slot no
    request holds."""
    H, HV, layers, num_slots = 1, 2, 3, 5
    meta = random_tree_metadata(gen, shapes, N)
    pools, slots, outs = verified_layers(gen, meta, layers, num_slots, H, HV, K, V, backend)
    leaf = torch.tensor([int(meta.num_nodes[0]) - 1, -1])
    before = [pool.clone() for pool in pools]
    one_by_one = [pool.clone() for pool in pools]
    for pool, layer_slots, out in zip(one_by_one, slots, outs):
        gdn_tree_commit(pool, layer_slots, meta, out, leaf, backend=backend)
    gdn_tree_commit_layers(pools, slots, meta, outs, leaf, backend=backend)
    for pool, want, old, layer_slots in zip(pools, one_by_one, before, slots):
        assert torch.equal(pool, want)
        assert not torch.equal(pool[int(layer_slots[0])], old[int(layer_slots[0])])
        assert torch.equal(pool[int(layer_slots[1])], old[int(layer_slots[1])])


def test_commit_of_several_layers_refuses_layers_unlike_layer_0(gen):
    """Every layer must match layer 0's layout (one launch reads them all at layer 0's
    strides); the error names the tensor and the layer."""
    N, H, HV, K, V = 9, 1, 2, 16, 16
    meta = random_tree_metadata(gen, ["random", "chain"], N)
    pools, slots, outs = verified_layers(gen, meta, 2, 4, H, HV, K, V)
    leaf = meta.num_nodes.long() - 1
    contiguous = [pools[0], pools[1].contiguous()]
    with pytest.raises(ValueError, match=r"ssm_states\[1\] must match ssm_states\[0\]'s dtype, shape, strides"):
        gdn_tree_commit_layers(contiguous, slots, meta, outs, leaf, backend="triton")
    with pytest.raises(ValueError, match=r"state_slots\[1\] must match"):
        gdn_tree_commit_layers(pools, [slots[0], slots[1].long()], meta, outs, leaf, backend="triton")
    with pytest.raises(ValueError, match="one entry per layer"):
        gdn_tree_commit_layers(pools, slots[:1], meta, outs, leaf)
    with pytest.raises(ValueError, match="at least one"):
        gdn_tree_commit_layers([], [], meta, [], leaf)


def test_a_second_commit_over_the_same_tensors_makes_no_table(gen, monkeypatch):
    """The layer table is made by the first commit over a set of tensors and found by the
    next (a CUDA graph's captured commit may not copy one from the host); other tensors
    get a table of their own, and the least recently used tables leave first."""
    monkeypatch.setattr(utils, "_DEVICE_TABLES", OrderedDict())
    monkeypatch.setattr(utils, "_MAX_DEVICE_TABLES", 2)
    N, H, HV, K, V = 5, 1, 1, 16, 16
    meta = random_tree_metadata(gen, ["random"], N)
    steps = [verified_layers(gen, meta, 2, 2, H, HV, K, V) for _ in range(3)]
    leaf = meta.num_nodes.long() - 1
    gdn_tree_commit_layers(*steps[0][:2], meta, steps[0][2], leaf, backend="triton")
    (table,) = utils._DEVICE_TABLES.values()
    assert table.shape == (2, 5) and table.dtype == torch.int64
    gdn_tree_commit_layers(*steps[0][:2], meta, steps[0][2], leaf, backend="triton")
    assert list(utils._DEVICE_TABLES.values()) == [table]
    for pools, slots, outs in steps[1:]:
        gdn_tree_commit_layers(pools, slots, meta, outs, leaf, backend="triton")
    assert len(utils._DEVICE_TABLES) == 2 and all(t is not table for t in utils._DEVICE_TABLES.values())
