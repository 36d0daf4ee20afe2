"""The device round against the reference builders, on CPU.

The round's frontier runs through take_top's Triton kernel (interpreted here),
the reference through the stable sorts it replaces; DraftRound runs the round
from its static buffers (the ones a CUDA graph replays). Trees must agree
exactly in tokens and parents; path scores within 1e-5. A sampled grid of
batch 1-32 and budgets 1-127, seeds printed.
"""

import zlib

import pytest
import torch

from vllm_tfm.drafting.builders import build_weaver_tree
from vllm_tfm.drafting.draft_round import CandidatePools, DraftRound, candidate_pools, draft_trees
from vllm_tfm.drafting.weaver import WeaverConfig
from vllm_tfm.drafting.weaver_checkpoint import random_weaver

NEG_INF = float("-inf")


class TableSession:
    """Vectorised Weaver stand-in: log q over a node's pool row from its depth, its
    token and its parent's token, so siblings and cousins differ. Integer-valued
    logits make exact ties when ``ties``."""

    def __init__(self, pool_logits, vocab, max_nodes, gen, ties):
        R, D, P = pool_logits.shape
        self.pool_logits, self.D = pool_logits, D
        shape = (vocab, vocab + 1, P)
        bump = torch.randint(-1, 2, shape, generator=gen).float() if ties else torch.randn(
            shape, generator=gen)
        self.bump = bump
        self.token_of = torch.full((R, max_nodes + 1), vocab, dtype=torch.int64)

    def expand(self, node_index, tokens, parent_index, depths):
        R = node_index.shape[0]
        batch = torch.arange(R)[:, None]
        real = node_index >= 0
        self.token_of[batch, torch.where(real, node_index, -1)] = tokens
        parent_token = torch.where(parent_index >= 0,
                                   self.token_of[batch, parent_index.clamp(min=0)],
                                   self.bump.shape[1] - 1)
        logits = self.pool_logits[batch, depths.clamp(max=self.D - 1)] + self.bump[
            tokens.clamp(max=self.bump.shape[0] - 1), parent_token]
        rows = torch.log_softmax(logits, -1)
        return rows.masked_fill(~(real & (depths < self.D))[..., None], NEG_INF)


def _pools(gen, R, D, P, V, ties):
    ids = torch.stack([torch.randperm(V, generator=gen)[:P] for _ in range(R * D)]).view(R, D, P)
    if ties:
        logits = torch.randint(-2, 3, (R, D, P), generator=gen).float()
    else:
        logits = torch.randn(R, D, P, generator=gen) * 2
    hole = torch.rand(R, D, P, generator=gen) < 0.2
    hole[..., 0] = False
    return torch.randint(0, V, (R,), generator=gen), ids, logits.masked_fill(hole, NEG_INF)


def _same_tree(got, want):
    assert torch.equal(got.num_nodes, want.num_nodes)
    assert torch.equal(got.tokens, want.tokens)
    assert torch.equal(got.parents, want.parents)
    assert torch.equal(got.depths, want.depths)
    assert torch.allclose(got.draft_logq, want.draft_logq, rtol=0, atol=1e-5)
    assert got.max_depth == want.max_depth


# (batch, budget, fanout, expand_width, D, P, ties): a sample of batch 1-32 x budget 1-127.
GRID = [
    (1, 1, 8, None, 15, 16, False),
    (1, 127, 8, None, 15, 12, True),
    (3, 64, 8, None, 15, 16, True),
    (8, 17, 4, 3, 6, 9, False),
    (6, 40, 8, None, 5, 10, True),
    (32, 20, 8, None, 15, 8, False),
    (32, 5, 2, 32, 4, 3, True),
]


@pytest.mark.parametrize("case", GRID)
def test_device_frontier_builds_the_reference_tree(case):
    R, budget, fanout, width, D, P, ties = case
    seed = zlib.crc32(repr(case).encode())
    print(f"seed {seed} for {case}")
    V = 24
    trees = []
    for backend in ("triton", "torch"):
        gen = torch.Generator().manual_seed(seed)
        roots, ids, logits = _pools(gen, R, D, P, V, ties)
        session = TableSession(logits, V, budget + 1, gen, ties)
        trees.append(build_weaver_tree(roots, ids, session, budget, fanout=fanout,
                                       expand_width=width, backend=backend))
    _same_tree(*trees)
    assert (trees[0].num_nodes > 1).all()


def _tiny_weaver(layout, seed):
    cfg = WeaverConfig(d_model=32, d_embed=24, d_rank=16, num_layers=1, num_heads=2, mlp_dim=20,
                       K=15, candidate_pool_size=16, layout=layout)
    weaver = random_weaver(cfg, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    weaver.prepare_tables(torch.randn(60, 24, generator=gen), torch.randn(60, 32, generator=gen))
    return weaver


@pytest.mark.parametrize("tree,layout", [("weaver", "rope_swiglu"), ("weaver", "learned_pos"),
                                         ("ddtree", "rope_swiglu"), ("chain", "rope_swiglu")])
def test_draft_round_equals_draft_trees(tree, layout):
    """Static buffers (bucket of 5, calls of 5 then 2 requests) give draft_trees' trees."""
    seed = zlib.crc32(f"{tree} {layout}".encode())
    print(f"seed {seed}")
    weaver = _tiny_weaver(layout, seed)
    budget, D, P = 30, 6, 16
    gen = torch.Generator().manual_seed(seed)
    round_ = DraftRound(tree, 5, D, P, budget, device="cpu", weaver=weaver,
                        backend="triton")
    for n in (5, 2):
        logits = torch.randn(n, D, 60, generator=gen) * 3
        pools = CandidatePools(*reversed(torch.topk(logits, P, dim=-1)))
        roots = torch.randint(0, 60, (n,), generator=gen)
        h_v, hidden = torch.randn(n, 32, generator=gen), torch.randn(n, D, 32, generator=gen)
        got = round_(roots, pools, h_v, hidden)
        want = draft_trees(tree, roots, pools, budget, weaver=weaver, h_v=h_v,
                           dflash_hidden=hidden, backend="torch")
        _same_tree(got, want)


def test_draft_round_rejects_bad_inputs():
    with pytest.raises(ValueError, match="tree must be one of"):
        DraftRound("beam", 2, 3, 4, 8, device="cpu")
    with pytest.raises(ValueError, match="needs weaver"):
        DraftRound("weaver", 2, 3, 4, 8, device="cpu")
    round_ = DraftRound("chain", 2, 3, 4, 8, device="cpu")
    pools = CandidatePools(torch.zeros(3, 3, 4, dtype=torch.int64), torch.zeros(3, 3, 4))
    with pytest.raises(ValueError, match="this round takes 1..2"):
        round_(torch.zeros(3, dtype=torch.int64), pools)
    with pytest.raises(ValueError, match="pools must be"):
        round_(torch.zeros(1, dtype=torch.int64), pools)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_candidate_pools_rank_in_the_logits_dtype_and_widen_only_the_pools(dtype):
    """The pools of 16-bit logits are their top values, widened to float32 exactly, in
    descending order, distinct ids (tied values may take either id); no wider than V."""
    gen = torch.Generator().manual_seed(11)
    logits = (torch.randn(2, 3, 1000, generator=gen) * 4).to(dtype)  # bf16 rounding makes ties
    pools = candidate_pools(logits, 64)
    assert pools.ids.dtype == torch.int64 and pools.scores.dtype == torch.float32
    assert pools.ids.shape == pools.scores.shape == (2, 3, 64)
    assert torch.equal(pools.scores, torch.topk(logits.float(), 64, dim=-1).values)
    assert torch.equal(logits.float().gather(-1, pools.ids), pools.scores)
    assert all(len(set(row.tolist())) == 64 for row in pools.ids.view(-1, 64))
    assert candidate_pools(logits[..., :40], 64).ids.shape == (2, 3, 40)
