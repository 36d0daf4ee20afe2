"""TreeMetadata against a brute-force per-node walk up the parent pointers, the
random trees every kernel test draws, and the package's import layout."""

import dataclasses
import importlib
import pkgutil

import pytest
import torch

import triton_ops
from triton_ops.testing import BUSHY_WINDOW, TREE_SHAPES, random_parents, random_tree_batch
from triton_ops.tree_metadata import (
    KERNEL_MAX_NODES,
    build_tree_metadata,
    pack_bitsets,
    unpack_bitsets,
)


def brute_force(parents, counts, conv_width):
    B, N = parents.shape
    ancestors = torch.zeros(B, N, N, dtype=torch.bool)
    depths = torch.zeros(B, N, dtype=torch.int32)
    conv = torch.zeros(B, N, conv_width, dtype=torch.int32)
    for b in range(B):
        for i in range(N):
            real = i < counts[b]
            path = [i]
            node = int(parents[b, i]) if real else -1
            while node >= 0:
                path.append(node)
                node = int(parents[b, node])
            for j in path:
                ancestors[b, i, j] = True
            depths[b, i] = len(path) - 1
            for t in range(conv_width):
                # Past the root the tap counts back into the committed columns.
                conv[b, i, t] = path[t] if t < len(path) else (len(path) - 1) - t
    return ancestors, depths, conv


def poison_empty(monkeypatch):
    """Every torch.empty comes back filled with garbage (True / -77), so an output the
    kernel leaves unwritten cannot pass for a right one."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(True if t.dtype == torch.bool else -77)

    monkeypatch.setattr(torch, "empty", poisoned)


@pytest.mark.parametrize("max_nodes", [1, 2, 3, 7, 16, 17, 63, 64, 65, 127, 128, 130])
@pytest.mark.parametrize("conv_width", [1, 2, 4])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_matches_brute_force(max_nodes, conv_width, backend, gen, monkeypatch):
    B = 5
    shapes = [TREE_SHAPES[int(i)] for i in torch.randint(0, len(TREE_SHAPES), (B,), generator=gen)]
    parents, num_nodes = random_tree_batch(gen, shapes, max_nodes)
    if backend == "triton" and max_nodes > KERNEL_MAX_NODES:
        with pytest.raises(ValueError, match="at most 128 nodes"):
            build_tree_metadata(parents, num_nodes, backend=backend)
        return
    counts = num_nodes.tolist()
    # The kernel reads any strides and either index dtype.
    parents = parents.int().t().contiguous().t() if max_nodes % 2 else parents
    poison_empty(monkeypatch)
    meta = build_tree_metadata(parents, num_nodes, conv_width=conv_width, backend=backend)
    monkeypatch.undo()
    ancestors, depths, conv = brute_force(parents, counts, conv_width)

    valid = torch.arange(max_nodes) < num_nodes.view(-1, 1)
    assert torch.equal(meta.valid, valid)
    assert torch.equal(meta.parents, torch.where(valid, parents, -1).to(torch.int32))
    assert meta.parents.dtype == torch.int32 and meta.depths.dtype == torch.int32
    assert torch.equal(meta.ancestors, ancestors)
    assert torch.equal(meta.depths, depths)
    assert torch.equal(meta.conv_sources, conv)
    assert meta.ancestor_words.shape == (B, max_nodes, -(-max_nodes // 64))
    assert torch.equal(unpack_bitsets(meta.ancestor_words, max_nodes), ancestors)
    assert (meta.batch_size, meta.max_nodes, meta.conv_width) == (B, max_nodes, conv_width)


@pytest.mark.parametrize("shape", TREE_SHAPES)
@pytest.mark.parametrize("max_nodes", [33, 65, 128])
def test_kernel_equals_torch_build_on_every_tree_shape(shape, max_nodes, gen):
    """Each shape full (a 127-deep chain takes every squaring) and cut short."""
    parents, num_nodes = random_tree_batch(gen, [shape] * 3, max_nodes,
                                           [max_nodes, max_nodes // 2, 1])
    kernel = build_tree_metadata(parents, num_nodes, backend="triton")
    torch_build = build_tree_metadata(parents, num_nodes, backend="torch")
    for field in dataclasses.fields(kernel):
        got, want = getattr(kernel, field.name), getattr(torch_build, field.name)
        assert got.dtype == want.dtype and torch.equal(got, want), field.name


def test_bitset_round_trip_and_bit_layout(gen):
    for n in (1, 63, 64, 65, 128, 200):
        mask = torch.rand(3, 4, n, generator=gen) < 0.5
        words = pack_bitsets(mask)
        assert words.dtype == torch.int64 and words.shape == (3, 4, -(-n // 64))
        assert torch.equal(unpack_bitsets(words, n), mask)
    one = torch.zeros(1, 130, dtype=torch.bool)
    one[0, 63] = True
    one[0, 129] = True
    words = pack_bitsets(one)
    assert words[0].tolist() == [-(2**63), 0, 1 << 1]


def test_path_mask():
    parents = torch.tensor([[-1, 0, 1, 0, 3, 2], [-1, -1, 0, 1, -1, -1]])
    meta = build_tree_metadata(parents, torch.tensor([6, 4]))
    got = meta.path_mask(torch.tensor([5, -1]))
    assert got.tolist() == [
        [True, True, True, False, False, True],
        [False] * 6,
    ]
    got = meta.path_mask(torch.tensor([4, 3], dtype=torch.int32))
    assert got[0].tolist() == [True, False, False, True, True, False]
    assert got[1].tolist() == [False, True, False, True, False, False]


@pytest.mark.parametrize(
    "parents, num_nodes, match",
    [
        ([[-1, 1, 0]], None, "topologically"),
        ([[-1, 0, 2]], None, "topologically"),
        ([[-1, -2, 0]], None, "out of range"),
        ([[-1, 0, 1]], [0], "num_nodes"),
        ([[-1, 0, 1]], [4], "num_nodes"),
        ([[-1, 0, 1]], [1, 1], "num_nodes"),
    ],
)
def test_rejects_bad_topology(parents, num_nodes, match):
    nn = None if num_nodes is None else torch.tensor(num_nodes)
    with pytest.raises(ValueError, match=match):
        build_tree_metadata(torch.tensor(parents), nn)


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="parents"):
        build_tree_metadata(torch.tensor([-1, 0]))
    with pytest.raises(ValueError, match="parents"):
        build_tree_metadata(torch.tensor([[-1.0, 0.0]]))
    with pytest.raises(ValueError, match="conv_width"):
        build_tree_metadata(torch.tensor([[-1, 0]]), conv_width=0)
    meta = build_tree_metadata(torch.tensor([[-1, 0, 1]]), torch.tensor([2]))
    with pytest.raises(ValueError, match="accepted_leaf"):
        meta.path_mask(torch.tensor([2]))
    with pytest.raises(ValueError, match="accepted_leaf"):
        meta.path_mask(torch.tensor([-2]))
    with pytest.raises(ValueError, match="accepted_leaf"):
        meta.path_mask(torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="accepted_leaf"):
        meta.path_mask(torch.tensor([0.0]))


@pytest.mark.parametrize("shape", TREE_SHAPES)
def test_random_trees_draw_parents_from_their_window(shape, gen):
    n = 40
    parents = random_parents(gen, shape, n)
    node = torch.arange(n)
    low = {"chain": node - 1, "star": torch.zeros_like(node), "random": torch.zeros_like(node),
           "bushy": (node - BUSHY_WINDOW).clamp(min=0), "forest": torch.full_like(node, -1)}[shape]
    assert parents[0] == -1
    assert bool(((parents[1:] >= low[1:]) & (parents[1:] < node[1:])).all()), parents.tolist()
    if shape != "forest":
        assert bool((parents[1:] >= 0).all())
    with pytest.raises(ValueError, match="shape must be one of"):
        random_parents(gen, "deep", n)


def test_importing_the_package_shadows_no_submodule():
    """``import triton_ops`` binds no exported name over a submodule: every dotted
    path still reaches its module (``triton_ops.tree_attention`` once was a function)."""
    names = [info.name for info in pkgutil.walk_packages(triton_ops.__path__, "triton_ops.")]
    assert "triton_ops.tree_attention.attention" in names and "triton_ops.gdn_tree.chunk" in names
    for name in names:
        module = importlib.import_module(name)
        reached = triton_ops
        for part in name.split(".")[1:]:
            reached = getattr(reached, part)
        assert reached is module, name
    for name in triton_ops.__all__:
        assert getattr(triton_ops, name) is not None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or triton_ops.utils.interpreting(),
                    reason="needs a CUDA GPU (TRITON_INTERPRET=0)")
@pytest.mark.parametrize("max_nodes", [1, 17, 64, 65, 128])
def test_kernel_on_cuda_equals_torch_build(max_nodes, gen):
    """The compiled kernel (fp16 closure dots) against the torch build, every tree shape."""
    shapes = [TREE_SHAPES[i % len(TREE_SHAPES)] for i in range(11)]
    parents, num_nodes = random_tree_batch(gen, shapes, max_nodes)
    parents, num_nodes = parents.cuda(), num_nodes.cuda()
    kernel = build_tree_metadata(parents, num_nodes, backend="auto")
    torch_build = build_tree_metadata(parents, num_nodes, backend="torch")
    for field in dataclasses.fields(kernel):
        got, want = getattr(kernel, field.name), getattr(torch_build, field.name)
        assert got.dtype == want.dtype and torch.equal(got, want), field.name
