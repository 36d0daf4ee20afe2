"""triton_ops.traversal: the kernels against the PyTorch path on random trees.

The PyTorch path is exact by enumeration (tests/test_verifiers.py, which also runs the
kernels through the whole verifier on tiny trees); here the kernels must give the same
law on trees of engine size: deterministic and sampled, every tree shape, padding
nodes, zero-mass children, targets with zeros and one-hots, pools of 512, outputs
poisoned with NaN first.
"""

import dataclasses

import pytest
import torch

from triton_ops.testing import random_tree_batch
from triton_ops.traversal import greedy_walk, sample_index, traversal_law, walk_choices
from triton_ops.tree_metadata import build_tree_metadata
from vllm_tfm.drafting.builders import build_sampled_tree
from vllm_tfm.drafting.tree import DraftTree
from vllm_tfm.benchmarks.launches import launches
from vllm_tfm.drafting.verifiers import (
    traversal_plan,
    verify_greedy,
    verify_target_only,
    verify_traversal,
    walk_plan,
)

F64 = torch.float64
TOL = 1e-12
LAW_FIELDS = ("alpha", "accept", "choice", "residual", "outside_scale")


def deterministic_trees(gen, shape, R, N, vocab):
    """R random trees of ``shape`` padded to N nodes (the first one full), distinct
    tokens, draft log q with a zero-mass child in every other request."""
    parents, counts = random_tree_batch(gen, [shape] * R, N)
    depths = build_tree_metadata(parents, counts).depths
    tokens = torch.randperm(vocab, generator=gen)[:N].repeat(R, 1)
    logq = torch.rand(R, N, generator=gen) * -4
    logq[1::2, N - 1] = float("-inf")
    return DraftTree(tokens=tokens, parents=parents.int(), depths=depths.int(), num_nodes=counts,
                     draft_logq=logq, max_depth=int(depths.max()) + 1)


def sampled_trees(gen, R, budget, depth, pool, vocab):
    """Sampled trees from random pools; draft laws with zero-mass entries."""
    pool_ids = torch.stack([torch.randperm(vocab, generator=gen)[:pool]
                            for _ in range(R * depth)]).view(R, depth, pool)
    logits = torch.randn(R, depth, pool, generator=gen) * 2
    tail = torch.rand(R, depth, pool - pool // 2, generator=gen) < 0.3
    logits[:, :, pool // 2:] = torch.where(tail, float("-inf"), logits[:, :, pool // 2:])
    seeds = torch.randint(0, 1 << 40, (R,), generator=gen)
    return build_sampled_tree(pool_ids[:, 0, 0], pool_ids, logits, budget, seeds)


def target_law(gen, R, N, vocab, kind):
    logits = torch.randn(R, N, vocab, generator=gen, dtype=F64) * (4.0 if kind == "peaky" else 1.0)
    probs = torch.softmax(logits, -1)
    if kind == "zeros":
        probs = torch.where(torch.rand(R, N, vocab, generator=gen) < 0.5, probs, 0.0)
        probs[..., 0] += 1e-3
    elif kind == "onehot":
        probs = torch.nn.functional.one_hot(probs.argmax(-1), vocab).to(F64)
    return probs


def poison_empty(monkeypatch):
    """Every torch.empty of the call comes back filled with NaN."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        out = empty(*args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out.fill_(-7)

    monkeypatch.setattr(torch, "empty", poisoned)


def assert_same_plans(tree, probs, keys, monkeypatch):
    want = traversal_plan(tree, probs, keys, backend="torch")
    with monkeypatch.context() as patch:
        poison_empty(patch)
        got = traversal_plan(tree, probs, keys, backend="triton")
    assert torch.equal(got.children, want.children)
    for name in LAW_FIELDS:
        a, b = getattr(got, name), getattr(want, name)
        assert not a.isnan().any(), name
        err = (a - b).abs().max().item() if a.numel() else 0.0
        assert err < TOL, f"{name}: max error {err:.3e}"
    return want


def assert_same_walks(gen, tree, probs, plan, rows=None):
    uniforms = torch.rand(tree.batch_size, tree.max_nodes, generator=gen, dtype=F64)
    bonus = torch.rand(tree.batch_size, generator=gen, dtype=F64)
    want = walk_plan(tree, plan, probs, uniforms, bonus, backend="torch")
    got = walk_plan(tree, plan, probs, uniforms, bonus, backend="triton")
    for field in dataclasses.fields(want):
        assert torch.equal(getattr(got, field.name), getattr(want, field.name)), field.name


@pytest.mark.parametrize("shape", ["chain", "star", "bushy", "random"])
@pytest.mark.parametrize("R,N", [(1, 1), (1, 2), (3, 7), (2, 17), (4, 33), (1, 65)])
@pytest.mark.parametrize("kind", ["smooth", "peaky", "zeros", "onehot"])
def test_deterministic_trees_match(shape, R, N, kind, gen, monkeypatch):
    vocab = N + 5
    tree = deterministic_trees(gen, shape, R, N, vocab)
    probs = target_law(gen, R, N, vocab, kind)
    keys = tree.draft_logq.double() + torch.rand(R, N, generator=gen, dtype=F64)
    plan = assert_same_plans(tree, probs, keys, monkeypatch)
    assert_same_walks(gen, tree, probs, plan)


@pytest.mark.parametrize("R,budget,depth,pool", [(1, 1, 2, 4), (3, 6, 3, 8), (2, 16, 5, 32),
                                                 (1, 64, 15, 512), (4, 32, 15, 64)])
@pytest.mark.parametrize("kind", ["smooth", "zeros", "onehot"])
def test_sampled_trees_match(R, budget, depth, pool, kind, gen, monkeypatch):
    vocab = pool + 37
    tree = sampled_trees(gen, R, budget, depth, pool, vocab)
    probs = target_law(gen, R, tree.max_nodes, vocab, kind)
    # Half the requests put most of the target on the pools (little mass outside).
    on_pool = torch.zeros(R, tree.max_nodes, vocab, dtype=torch.bool)
    on_pool.scatter_(2, tree.pool_ids[:, :1, :].expand(-1, tree.max_nodes, -1), True)
    probs[::2] = torch.where(on_pool[::2], probs[::2] * 50, probs[::2])
    probs = probs / probs.sum(-1, keepdim=True)
    plan = assert_same_plans(tree, probs, None, monkeypatch)
    assert_same_walks(gen, tree, probs, plan)


def test_walk_never_picks_a_zero_weight_tail():
    """The largest uniform (1 - 2^-53) stops short of trailing zero weights, as
    sample_index does."""
    last = 1 - 2.0**-53
    choice = torch.tensor([[[0.5, 0.5, 0.0], [0.0, 0.0, 1.0], [0.0, 0.0, 1.0]]], dtype=F64)
    children = torch.tensor([[[1, 2], [-1, -1], [-1, -1]]])
    uniforms = torch.full((1, 3), last, dtype=F64)
    for backend in ("torch", "triton"):
        leaf, on_path = walk_choices(choice, children, uniforms, max_depth=1, backend=backend)
        assert leaf.tolist() == [2] and on_path.tolist() == [[True, False, True]], backend
    assert sample_index(choice[0, :1], torch.tensor([last], dtype=F64)).tolist() == [1]


def test_bad_arguments_name_the_field():
    R, N, K, S = 2, 3, 2, 4
    index = torch.zeros(R, N, dtype=torch.int64)
    children = torch.full((R, N, K), -1)
    law = torch.zeros(R, N, S, dtype=F64)
    outside = torch.zeros(R, N, dtype=F64)
    with pytest.raises(ValueError, match="order must be"):
        traversal_law(index, index[:, :2], children, index, law, outside, law, 1)
    with pytest.raises(ValueError, match="target must be float64"):
        traversal_law(index, index, children, index, law.float(), outside, law, 1)
    with pytest.raises(ValueError, match="children must be int32/int64"):
        traversal_law(index, index, children.double(), index, law, outside, law, 1)
    with pytest.raises(ValueError, match="target and proposal"):
        traversal_law(index, index, children, index, law, outside, law[..., :2], 1)
    with pytest.raises(ValueError, match="choice must be"):
        walk_choices(torch.zeros(R, N, K, dtype=F64), children, outside, 1)
    with pytest.raises(ValueError, match="uniforms must be"):
        walk_choices(torch.zeros(R, N, K + 1, dtype=F64), children, index, 1)
    with pytest.raises(ValueError, match="backend must be one of"):
        walk_choices(torch.zeros(R, N, K + 1, dtype=F64), children, outside, 1, backend="cuda")


def test_the_sampled_verifiers_launch_a_bounded_number_of_kernels(gen):
    """Model runner V2 verifies outside its graphs, so each launch is host time every step.
    At budget 64 the kernel paths launch ~140 (traversal) and ~95 (target-only), against
    ~4.4k and ~380 for the PyTorch loops (BENCHMARKS.md, "Sampled verifiers' launches");
    these bounds catch a loop that creeps back. (validate=False, as the engine calls them.)"""
    tree = sampled_trees(gen, 1, 64, 15, 512, 4096)
    plain = dataclasses.replace(tree, pool_ids=None, proposal_logq=None)
    probs = target_law(gen, 1, tree.max_nodes, 4096, "smooth")
    seeds = torch.tensor([7])
    assert launches(lambda: verify_traversal(tree, probs, seeds, False, "triton")) <= 160
    assert launches(lambda: verify_target_only(plain, probs, seeds, False, "triton")) <= 110
    assert launches(lambda: verify_traversal(tree, probs, seeds, False, "torch")) > 1000


def greedy_picks(gen, tree: DraftTree, follow: float) -> torch.Tensor:
    """[R, N] picks: with probability ``follow`` a node picks one of its children's tokens
    (paths run deep), else a token no node holds."""
    R, N = tree.tokens.shape
    picks = torch.full((R, N), int(tree.tokens.max()) + 1)
    for r in range(R):
        count = int(tree.num_nodes[r])
        parents = tree.parents[r, :count].tolist()
        for i in range(count):
            kids = [j for j in range(count) if parents[j] == i]
            if kids and torch.rand((), generator=gen) < follow:
                pick = kids[int(torch.randint(len(kids), (), generator=gen))]
                picks[r, i] = tree.tokens[r, pick]
    return picks


def hand_walk(tree: DraftTree, picks: torch.Tensor, r: int) -> list[int]:
    """Request r's greedy path, one node at a time."""
    count = int(tree.num_nodes[r])
    path = [0]
    while True:
        kids = [j for j in range(1, count) if int(tree.parents[r, j]) == path[-1]
                and int(tree.tokens[r, j]) == int(picks[r, path[-1]])]
        if not kids:
            return path
        path.append(kids[0])


@pytest.mark.parametrize("shape", ["chain", "star", "bushy", "random"])
@pytest.mark.parametrize("R,N", [(1, 1), (1, 2), (3, 7), (2, 17), (4, 33), (1, 65), (2, 129)])
@pytest.mark.parametrize("follow", [0.0, 0.7, 1.0])
def test_greedy_walk_kernel_follows_the_picks_as_the_torch_path(shape, R, N, follow, gen,
                                                                monkeypatch):
    tree = deterministic_trees(gen, shape, R, N, N + 5)
    picks = greedy_picks(gen, tree, follow)
    args = (tree.tokens, tree.parents, picks, tree.num_nodes, tree.max_depth)
    want_leaf, want_path = greedy_walk(*args, backend="torch")
    with monkeypatch.context() as patch:
        poison_empty(patch)
        leaf, on_path = greedy_walk(*args, backend="triton")
    assert torch.equal(leaf, want_leaf) and torch.equal(on_path, want_path)
    for r in range(R):
        path = hand_walk(tree, picks, r)
        assert int(leaf[r]) == path[-1]
        assert on_path[r].nonzero()[:, 0].tolist() == sorted(path)


def test_greedy_verification_launches_a_bounded_number_of_kernels(gen):
    """Model runner V2 verifies eagerly: each launch is host time every step. At budget 64
    the PyTorch path's pointer jumping launches ~70, the kernel path ~17."""
    tree = deterministic_trees(gen, "bushy", 1, 65, 4096)
    logits = torch.randn(1, 65, 4096, generator=gen)
    kernel = verify_greedy(tree, logits, False, "triton")
    reference = verify_greedy(tree, logits, False, "torch")
    for field in dataclasses.fields(reference):
        assert torch.equal(getattr(kernel, field.name), getattr(reference, field.name))
    assert launches(lambda: verify_greedy(tree, logits, False, "triton")) <= 20
    assert launches(lambda: verify_greedy(tree, logits, False, "torch")) > 60
