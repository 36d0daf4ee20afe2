"""Builders against brute-force single-request references; DraftTree helpers.

Pools use integer-valued logits in half the cases so scores tie exactly and
the documented tie-breaking is exercised; some use -inf logits.
"""

import math
import zlib
from dataclasses import fields

import numpy as np
import pytest
import torch

from triton_ops.counter_random import counter_gumbel
from vllm_tfm.drafting.builders import (
    BUILD_STREAM,
    SAMPLED_FIRST_RANK_EXPONENT,
    build_chain,
    build_ddtree,
    build_sampled_tree,
    sampled_call_widths,
    build_weaver_tree,
)
from vllm_tfm.drafting.tree import DraftTree
from vllm_tfm.drafting.verifiers import verify_traversal
from vllm_tfm.drafting.weaver import WeaverConfig
from vllm_tfm.drafting.weaver_checkpoint import random_weaver
from vllm_tfm.options import default_expand_width

NEG_INF = float("-inf")


def seed_of(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def make_pools(gen, R, D, P, V, ties=False, holes=False):
    ids = torch.stack([
        torch.stack([torch.randperm(V, generator=gen)[:P] for _ in range(D)]) for _ in range(R)
    ])
    if ties:
        logits = torch.randint(-2, 3, (R, D, P), generator=gen).float()
    else:
        logits = torch.randn(R, D, P, generator=gen) * 2
    if holes and P > 1:
        hole = torch.rand(R, D, P, generator=gen) < 0.3
        hole[..., 0] = False
        logits = logits.masked_fill(hole, NEG_INF)
    roots = torch.randint(0, V, (R,), generator=gen)
    return roots, ids, logits


def check_invariants(tree: DraftTree, budget: int, max_depth: int):
    tree.validate()
    assert (tree.num_nodes <= budget + 1).all()
    valid = tree.valid
    assert (tree.tokens[~valid] == 0).all()
    assert (tree.parents[~valid] == -1).all()
    assert (tree.depths[~valid] == 0).all()
    assert (tree.draft_logq[~valid] == 0).all()
    assert (tree.depths[valid] <= max_depth).all()
    drafted = valid.clone()
    drafted[:, 0] = False
    if not tree.sampled:
        assert torch.isfinite(tree.draft_logq[drafted]).all()
        assert (tree.draft_logq[drafted] <= 0).all()
    meta = tree.to_metadata()
    assert torch.equal(meta.depths[valid], tree.depths[valid])


def tree_rows(tree: DraftTree, r: int):
    n = int(tree.num_nodes[r])
    return [
        (int(tree.tokens[r, i]), int(tree.parents[r, i]), int(tree.depths[r, i]),
         float(tree.draft_logq[r, i]))
        for i in range(n)
    ]


# -- chain ------------------------------------------------------------------------------

@pytest.mark.parametrize("budget", [0, 1, 3, 15, 20])
@pytest.mark.parametrize("ties", [False, True])
def test_chain_is_the_argmax_of_each_marginal(budget, ties):
    gen = torch.Generator().manual_seed(seed_of("chain", budget, ties))
    roots, ids, logits = make_pools(gen, 3, 15, 6, 40, ties=ties, holes=True)
    tree = build_chain(roots, ids, logits, budget)
    n = min(budget, 15)
    check_invariants(tree, n, 15)
    logp = torch.log_softmax(logits, -1)
    for r in range(3):
        want = [(int(roots[r]), -1, 0, 0.0)]
        for d in range(n):
            best = max(range(6), key=lambda i: (float(logp[r, d, i]), -i))
            want.append((int(ids[r, d, best]), d, d + 1, float(logp[r, d, best])))
        assert tree_rows(tree, r) == want


# -- DDTree ----------------------------------------------------------------------------

def brute_ddtree(root, ids, logp, budget):
    """Enumerate every prefix, rank by the documented order, keep the top budget."""
    D, P = logp.shape
    order = [sorted(range(P), key=lambda i: (-float(logp[d, i]), i)) for d in range(D)]
    lp = [[np.float32(logp[d, order[d][k]]) for k in range(P)] for d in range(D)]
    levels, prev = [], [np.float32(0.0)]
    for d in range(D):
        cand = [
            (np.float32(s + lp[d][k]), ppos, k) for ppos, s in enumerate(prev) for k in range(P)
        ]
        cand.sort(key=lambda e: (-e[0], e[1], e[2]))
        levels.append(cand)
        prev = [e[0] for e in cand]
    flat = [(e[0], d, pos) for d, level in enumerate(levels) for pos, e in enumerate(level)]
    flat.sort(key=lambda x: (-x[0], x[1], x[2]))
    chosen = [x for x in flat[:budget] if x[0] > NEG_INF]
    node_of = {(d, pos): i + 1 for i, (_, d, pos) in enumerate(chosen)}
    rows = [(root, -1, 0, 0.0)]
    for _, d, pos in chosen:
        _, ppos, k = levels[d][pos]
        parent = 0 if d == 0 else node_of[(d - 1, ppos)]
        rows.append((int(ids[d, order[d][k]]), parent, d + 1, float(lp[d][k])))
    return rows


@pytest.mark.parametrize("budget", [0, 1, 2, 5, 9, 17, 40, 200])
@pytest.mark.parametrize("shape", [(3, 4), (4, 3), (2, 6)])
@pytest.mark.parametrize("ties,holes", [(False, False), (True, False), (True, True)])
def test_ddtree_is_the_top_budget_prefixes(budget, shape, ties, holes):
    D, P = shape
    gen = torch.Generator().manual_seed(seed_of("dd", budget, shape, ties, holes))
    roots, ids, logits = make_pools(gen, 3, D, P, 30, ties=ties, holes=holes)
    tree = build_ddtree(roots, ids, logits, budget)
    assert tree.max_nodes == budget + 1
    check_invariants(tree, budget, D)
    logp = torch.log_softmax(logits.float(), dim=-1)
    for r in range(3):
        assert tree_rows(tree, r) == brute_ddtree(int(roots[r]), ids[r], logp[r], budget)


# -- Weaver best-first ------------------------------------------------------------------

class FakeSession:
    """Weaver stand-in: log q from a table keyed by (depth, token, parent token).

    Checks the call contract (fresh node indices, parents expanded by an
    earlier call, consistent depths) and records each call's width.
    """

    def __init__(self, pool_ids, pool_logits, vocab, gen, ties):
        R, D, P = pool_ids.shape
        self.R, self.D, self.P = R, D, P
        if ties:
            bump = torch.randint(-1, 2, (R, D, vocab, vocab + 1, P), generator=gen).float()
        else:
            bump = torch.randn(R, D, vocab, vocab + 1, P, generator=gen)
        self.table = torch.log_softmax(pool_logits[:, :, None, None, :] + bump, dim=-1)
        self.token = [dict() for _ in range(R)]
        self.depth = [dict() for _ in range(R)]
        self.calls: list[int] = []

    def logq(self, r, depth, token, parent_token):
        if depth >= self.D:
            return torch.full((self.P,), NEG_INF)
        return self.table[r, depth, token, parent_token + 1]

    def expand(self, node_index, tokens, parent_index, depths):
        for t in (node_index, tokens, parent_index, depths):
            assert t.dtype == torch.int64 and t.shape == node_index.shape
        call = len(self.calls)
        self.calls.append(node_index.shape[1])
        out = torch.full((self.R, node_index.shape[1], self.P), NEG_INF)
        for r in range(self.R):
            for j in range(node_index.shape[1]):
                n = int(node_index[r, j])
                if n < 0:
                    continue
                assert n not in self.token[r], "node index reused"
                p, d, tok = int(parent_index[r, j]), int(depths[r, j]), int(tokens[r, j])
                if p >= 0:
                    assert p in self.token[r], "unknown parent"
                    assert self.token[r][p][1] < call, "parent not expanded by an earlier call"
                    assert d == self.depth[r][p] + 1
                    parent_token = self.token[r][p][0]
                else:
                    assert d == 0
                    parent_token = -1
                self.token[r][n] = (tok, call)
                self.depth[r][n] = d
                out[r, j] = self.logq(r, d, tok, parent_token)
        return out


def brute_weaver(session, r, root, ids, budget, fanout, width, max_depth, draw=None,
                 first_exponent=SAMPLED_FIRST_RANK_EXPONENT):
    """Single-request best-first with a Python list as the frontier; a node's score is its
    entry's. ``draw(i, row)``: a sampled tree's pool positions for node i's child slots in
    drawn order (slot k scores the k-th largest log q, the first times ``first_exponent``,
    and holds the k-th drawn token)."""
    D, P = ids.shape
    nodes = [dict(token=root, parent=-1, depth=0, logq=0.0, score=np.float32(0.0))]
    frontier, seq = [], 0
    pops = [min(width, budget - s) for s in range(0, budget, width)] if max_depth > 0 else []

    def push(i):
        nonlocal seq
        node = nodes[i]
        if node["depth"] >= max_depth:
            return
        parent_token = nodes[node["parent"]]["token"] if node["parent"] >= 0 else -1
        row = session.logq(r, node["depth"], node["token"], parent_token).numpy()
        ranked = sorted(range(P), key=lambda k: (-row[k], k))[: min(fanout, P)]
        picks = ranked if draw is None else draw(i, row)[: len(ranked)]
        for place, (rank, k) in enumerate(zip(ranked, picks)):
            if row[rank] == NEG_INF:
                continue
            value = row[rank]
            if draw is not None and place == 0:
                value = np.float32(value * np.float32(first_exponent))
            frontier.append(dict(score=np.float32(node["score"] + value), seq=seq, parent=i,
                                 token=int(ids[node["depth"], k]), logq=row[k],
                                 depth=node["depth"] + 1))
            seq += 1

    if pops:
        push(0)
    for step, k in enumerate(pops):
        frontier.sort(key=lambda e: (-e["score"], e["seq"]))
        popped, frontier[:] = frontier[:k], frontier[k:]
        added = []
        for e in popped:
            nodes.append(dict(token=e["token"], parent=e["parent"], depth=e["depth"],
                              logq=e["logq"], score=e["score"]))
            added.append(len(nodes) - 1)
        if step + 1 < len(pops):
            for i in added:
                push(i)
    return [(n["token"], n["parent"], n["depth"], float(n["logq"])) for n in nodes]


WEAVER_CASES = [
    # budget, fanout, width, max_depth, D, P
    (0, 8, None, None, 4, 6),
    (1, 8, None, None, 4, 6),
    (7, 3, 1, None, 4, 6),
    (20, 4, 3, None, 5, 6),
    (20, 8, 32, None, 5, 6),
    (33, 8, None, 2, 5, 6),
    (12, 2, 2, 0, 4, 5),
    (10, 2, 2, None, 2, 2),  # frontier runs dry: at most 2 + 4 drafted nodes
    (16, 10, 4, None, 3, 4),  # fanout above the pool size
]


@pytest.mark.parametrize("case", WEAVER_CASES)
@pytest.mark.parametrize("ties,holes", [(False, False), (True, True)])
def test_weaver_tree_matches_brute_force(case, ties, holes):
    budget, fanout, width, max_depth, D, P = case
    gen = torch.Generator().manual_seed(seed_of("weaver", case, ties, holes))
    V, R = 12, 3
    roots, ids, logits = make_pools(gen, R, D, P, V, ties=ties, holes=holes)
    session = FakeSession(ids, logits, V, gen, ties)
    tree = build_weaver_tree(roots, ids, session, budget, fanout=fanout, expand_width=width,
                             max_depth=max_depth)
    depth_limit = D if max_depth is None else max_depth
    assert tree.max_nodes == budget + 1 and tree.max_depth == depth_limit
    check_invariants(tree, budget, depth_limit)
    w = width or default_expand_width(budget)
    pops = len(range(0, budget, w)) if depth_limit > 0 else 0
    assert len(session.calls) == pops  # the root's call + one per pop but the last
    for r in range(R):
        want = brute_weaver(session, r, int(roots[r]), ids[r], budget, fanout, w, depth_limit)
        assert tree_rows(tree, r) == want
    if case[0] == 10 and D == 2:
        assert (tree.num_nodes <= 1 + 2 + 4).all() and (tree.num_nodes < budget + 1).all()


@pytest.mark.parametrize("case", WEAVER_CASES)
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("first_exponent", [SAMPLED_FIRST_RANK_EXPONENT, 1.0])
def test_sampled_weaver_tree_matches_brute_force(case, backend, first_exponent):
    """With seeds: the best-first tree whose slots score by rank and hold the node's
    Gumbel-top-k draws (keys from the request's seed, the node index and the pool position),
    node for node the brute force's; proposals are the session's rows at the nodes with
    children and -inf elsewhere."""
    budget, fanout, width, max_depth, D, P = case
    gen = torch.Generator().manual_seed(seed_of("sampled weaver", case))
    V, R = 12, 3
    roots, ids, logits = make_pools(gen, R, D, P, V, holes=True)
    session = FakeSession(ids, logits, V, gen, ties=False)
    seeds = torch.tensor([11, 5, 2**40 + 3])
    tree = build_weaver_tree(roots, ids, session, budget, fanout=fanout, expand_width=width,
                             max_depth=max_depth, backend=backend, seeds=seeds,
                             first_exponent=first_exponent)
    depth_limit = D if max_depth is None else max_depth
    check_invariants(tree, budget, depth_limit)
    assert tree.sampled and torch.equal(tree.pool_ids, ids)
    w = width or default_expand_width(budget)
    children, counts = tree.children()
    for r in range(R):
        def draw(i, row, r=r):
            counters = torch.arange(P, dtype=torch.int64) + i * P
            keys = torch.from_numpy(row).double() + counter_gumbel(seeds[r:r + 1], BUILD_STREAM,
                                                                   counters[None])[0]
            return sorted(range(P), key=lambda k: (-float(keys[k]), k))

        want = brute_weaver(session, r, int(roots[r]), ids[r], budget, fanout, w, depth_limit,
                            draw, first_exponent)
        assert tree_rows(tree, r) == want
        for i, (token, parent, depth, _) in enumerate(want):
            row = tree.proposal_logq[r, i]
            if counts[r, i] > 0:
                ptoken = want[parent][0] if parent >= 0 else -1
                assert torch.equal(row, session.logq(r, depth, token, ptoken))
            else:
                assert (row == NEG_INF).all()
    assert (tree.proposal_logq[~tree.valid] == NEG_INF).all()


@pytest.mark.parametrize("budget,fanout", [(6, 8), (25, 4)])
def test_builders_drive_a_real_weaver_round(budget, fanout):
    """The real WeaverRound accepts the builders' calls (its own contract checks
    run) and the tree's log q are the round's: replaying each node's path
    through a fresh round gives the same values."""
    cfg = WeaverConfig(d_model=32, d_embed=24, d_rank=16, num_layers=1, num_heads=2, mlp_dim=20,
                       K=5, candidate_pool_size=8, layout="learned_pos", extra={})
    weaver = random_weaver(cfg, seed=3)
    gen = torch.Generator().manual_seed(budget)
    V, R, D, P = 60, 2, 5, 8
    weaver.prepare_tables(torch.randn(V, 24, generator=gen), torch.randn(V, 32, generator=gen) / 4)
    roots, ids, logits = make_pools(gen, R, D, P, V)
    h_v, hidden = torch.randn(R, 32, generator=gen), torch.randn(R, D, 32, generator=gen)

    def fresh_round():
        return weaver.start_round(h_v, hidden, ids, logits * 3, max_nodes=budget + 1)

    tree = build_weaver_tree(roots, ids, fresh_round(), budget, fanout=fanout)
    check_invariants(tree, budget, D)
    seeds = torch.tensor([5, 6])
    sampled = build_weaver_tree(roots, ids, fresh_round(), budget, fanout=fanout, seeds=seeds)
    check_invariants(sampled, budget, D)
    for t in (tree, sampled):
        # Expand every node again, one depth per call, in a fresh round.
        replay = fresh_round()
        rows = {}
        for d in range(int(t.depths.max()) + 1):
            here = (t.depths == d) & t.valid
            width = int(here.sum(1).max())
            order = torch.argsort((~here).int(), dim=1, stable=True)[:, :width]
            real = here.gather(1, order)
            node = torch.where(real, order, -1)
            out = replay.expand(node, t.tokens.gather(1, order),
                                torch.where(real, t.parents.long().gather(1, order), -1),
                                torch.full_like(order, d))
            for r in range(R):
                for j in range(width):
                    if real[r, j]:
                        rows[(r, int(order[r, j]))] = out[r, j]
        for r in range(R):
            for i in range(1, int(t.num_nodes[r])):
                p = int(t.parents[r, i])
                pos = int((ids[r, int(t.depths[r, p])] == t.tokens[r, i]).nonzero()[0, 0])
                assert torch.allclose(t.draft_logq[r, i], rows[(r, p)][pos], rtol=0, atol=1e-5)


def test_default_expand_width():
    widths = [default_expand_width(b) for b in (0, 1, 16, 17, 64, 128, 1000)]
    assert widths == [1, 1, 1, 2, 4, 8, 32]


# -- sampled trees ----------------------------------------------------------------------

@pytest.mark.parametrize("first_exponent", [1.0, 0.5, 0.3])
def test_sampled_tree_has_the_ddtree_shape_and_its_draws(first_exponent):
    """The shape is DDTree's over the marginals with each depth's largest log-prob times
    ``first_exponent`` (brute force); the children are draws from the marginals themselves."""
    gen = torch.Generator().manual_seed(4)
    R, D, P, V, budget = 4, 4, 5, 30, 14
    roots, ids, logits = make_pools(gen, R, D, P, V, holes=True)
    seeds = torch.tensor([3, 1, 4, 1], dtype=torch.int64)
    tree = build_sampled_tree(roots, ids, logits, budget, seeds, first_exponent=first_exponent)
    check_invariants(tree, budget, D)
    marginal = torch.log_softmax(logits, -1)
    scaled = marginal.clone()
    for r in range(R):
        for d in range(D):
            top = int(marginal[r, d].argmax())
            scaled[r, d, top] = marginal[r, d, top] * first_exponent
        want = brute_ddtree(int(roots[r]), ids[r], scaled[r], budget)
        assert [row[1:3] for row in tree_rows(tree, r)] == [row[1:3] for row in want]
    if first_exponent == 1.0:
        shape = build_ddtree(roots, ids, logits, budget)
        assert torch.equal(tree.parents, shape.parents) and torch.equal(tree.depths, shape.depths)
        assert torch.equal(tree.num_nodes, shape.num_nodes)
    children, counts = tree.children()
    for r in range(R):
        for i in range(int(tree.num_nodes[r])):
            d = int(tree.depths[r, i])
            if counts[r, i] > 0:
                want = marginal[r, d]
                assert torch.equal(tree.proposal_logq[r, i], want)
                for c in children[r, i][children[r, i] >= 0].tolist():
                    pos = int((ids[r, d] == tree.tokens[r, c]).nonzero()[0, 0])
                    assert float(tree.draft_logq[r, c]) == float(want[pos])
            else:
                assert (tree.proposal_logq[r, i] == NEG_INF).all()
    assert (tree.proposal_logq[~tree.valid] == NEG_INF).all()


def test_sampled_children_are_drawn_without_replacement():
    n, P = 20000, 4
    logits = torch.tensor([[[2.0, 1.0, 0.5, NEG_INF]]]).expand(n, 1, P)
    ids = torch.tensor([[[7, 3, 9, 1]]]).expand(n, 1, P)
    seeds = torch.arange(n, dtype=torch.int64) * 31 + 5
    # D = 1 and three ids with mass: the root's three children are its first
    # three draws, in draw order.
    tree = build_sampled_tree(torch.zeros(n, dtype=torch.int64), ids, logits, 3, seeds)
    assert (tree.num_nodes == 4).all()
    q = torch.softmax(logits[0, 0].double(), 0)
    law = {}
    for a in range(3):
        for b in range(3):
            if a != b:
                law[(a, b)] = float(q[a] * q[b] / (1 - q[a]))
    pos = {7: 0, 3: 1, 9: 2, 1: 3}
    counts = {}
    for row in tree.tokens[:, 1:3].tolist():
        key = (pos[row[0]], pos[row[1]])
        counts[key] = counts.get(key, 0) + 1
    for key in set(law) | set(counts):
        p, f = law.get(key, 0.0), counts.get(key, 0) / n
        assert abs(f - p) <= 5 * math.sqrt(p * (1 - p) / n) + 2 / n, (key, f, p)
    # The third child is always the remaining id with mass, never the hole.
    assert set(tree.tokens[:, 1:4].flatten().tolist()) == {7, 3, 9}


def test_sampled_tree_beyond_the_support_gets_zero_mass_children():
    ids = torch.tensor([[[5, 6, 7]]])
    logits = torch.tensor([[[0.0, NEG_INF, NEG_INF]]])
    tree = build_sampled_tree(torch.tensor([1]), ids, logits, 1, torch.tensor([0]))
    assert tree.tokens[0].tolist() == [1, 5]


def test_sampled_weaver_tree_never_spends_nodes_beyond_the_support():
    """A Weaver slot past q's support scores -inf: it never enters the tree, and the budget
    goes to the rest of the frontier."""
    class Narrow:  # one candidate with mass below the root, every candidate below the rest
        def expand(self, node_index, tokens, parent_index, depths):
            row = torch.where(node_index[..., None] == 0, torch.tensor([0.0, NEG_INF, NEG_INF]),
                              torch.log(torch.full((3,), 1 / 3)))
            return row.float()

    ids = torch.tensor([[[5, 6, 7], [2, 3, 4]]])
    tree = build_weaver_tree(torch.tensor([1]), ids, Narrow(), 3, expand_width=1,
                             seeds=torch.tensor([0]))
    assert int(tree.num_nodes[0]) == 4
    assert tree.parents[0].tolist() == [-1, 0, 1, 1] and tree.tokens[0, 1] == 5
    assert (tree.draft_logq[0, 1:] > NEG_INF).all()


def test_sampled_trees_reproduce_and_ignore_the_batch():
    gen = torch.Generator().manual_seed(9)
    roots, ids, logits = make_pools(gen, 4, 4, 6, 50)
    seeds = torch.tensor([10, 20, 30, 40])
    a = build_sampled_tree(roots, ids, logits, 12, seeds)
    b = build_sampled_tree(roots, ids, logits, 12, seeds)
    rows = torch.tensor([3, 1])
    c = build_sampled_tree(roots[rows], ids[rows], logits[rows], 12, seeds[rows])
    for f in fields(DraftTree):
        x = getattr(a, f.name)
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, getattr(b, f.name))
            assert torch.equal(x[rows], getattr(c, f.name))
    d = build_sampled_tree(roots, ids, logits, 12, seeds + 1)
    assert not torch.equal(a.tokens, d.tokens)


def test_sampled_tree_with_traversal_is_a_target_sample():
    """End to end with the production randomness: sampled tree + traversal
    verification, against a Markov target (next token depends on depth and
    last token). The law of the first two output tokens (a one-token output
    is extended by one target draw) must be the target's."""
    n, V, D, P, budget = 30000, 4, 3, 3, 5
    gen = torch.Generator().manual_seed(21)
    _, ids, logits = make_pools(gen, 1, D, P, V)
    ids, logits = ids.expand(n, -1, -1), logits.expand(n, -1, -1)
    roots = torch.zeros(n, dtype=torch.int64)
    markov = torch.softmax(torch.randn(D + 1, V, V, generator=gen, dtype=torch.float64) * 1.5, -1)
    seeds = torch.arange(n, dtype=torch.int64) * 7 + 1
    tree = build_sampled_tree(roots, ids, logits, budget, seeds)
    probs = markov[tree.depths.long(), tree.tokens]
    result = verify_traversal(tree, probs, seeds + 99)
    first = result.output_tokens[:, 0]
    second = result.output_tokens[:, 1]
    draw = torch.multinomial(markov[1, first.clamp(min=0)], 1, generator=gen)[:, 0]
    second = torch.where(second >= 0, second, draw)
    law = markov[0, 0][:, None] * markov[1]
    counts = torch.zeros(V, V)
    counts.index_put_((first, second), torch.ones(n), accumulate=True)
    freq = counts.double() / n
    bound = 5 * torch.sqrt(law * (1 - law) / n) + 2 / n
    assert ((freq - law).abs() <= bound).all(), (freq, law)
    assert float(result.accepted_len.double().mean()) > 0.5



@pytest.mark.parametrize("tree_kind", ["ddtree", "weaver"])
def test_mixed_batches_draft_each_request_as_alone(tree_kind):
    """``draft_trees_per_request`` (the proposer's call): deterministic rows are the
    deterministic batch's rows bit for bit, sampled rows the all-sampled batch's, and
    the deterministic rows carry no proposal mass; no sampled row is exactly
    ``draft_trees``."""
    from vllm_tfm.drafting.draft_round import CandidatePools, draft_trees, draft_trees_per_request

    gen = torch.Generator().manual_seed(seed_of("mixed", tree_kind))
    R, D, P, V, budget = 5, 4, 8, 40, 9
    roots, ids, logits = make_pools(gen, R, D, P, V)
    pools = CandidatePools(ids, logits)
    extra = {}
    if tree_kind == "weaver":
        cfg = WeaverConfig(d_model=32, d_embed=24, d_rank=16, num_layers=1, num_heads=2,
                           mlp_dim=20, K=5, candidate_pool_size=8, layout="learned_pos",
                           extra={})
        weaver = random_weaver(cfg, seed=2)
        weaver.prepare_tables(torch.randn(V, 24, generator=gen),
                              torch.randn(V, 32, generator=gen) / 4)
        extra = dict(weaver=weaver, h_v=torch.randn(R, 32, generator=gen),
                     dflash_hidden=torch.randn(R, D, 32, generator=gen))
    seeds = torch.arange(R, dtype=torch.int64) + 11
    sampled = [True, False, False, True, False]
    mixed = draft_trees_per_request(tree_kind, roots, pools, budget, sampled, seeds, **extra)
    assert mixed.sampled
    plain = draft_trees(tree_kind, roots, pools, budget, **extra)
    drawn = draft_trees(tree_kind, roots, pools, budget, sample_seeds=seeds, **extra)
    mixed.validate(vocab_size=V)
    for r, want in enumerate(sampled):
        source = drawn if want else plain
        for name in ("tokens", "parents", "depths", "num_nodes"):
            assert torch.equal(getattr(mixed, name)[r], getattr(source, name)[r]), (r, name)
        # Weaver's matmuls round differently for a batch of other size.
        assert torch.allclose(mixed.draft_logq[r], source.draft_logq[r], rtol=0, atol=1e-5)
        assert torch.equal(mixed.pool_ids[r], ids[r])
        if want:
            assert torch.allclose(mixed.proposal_logq[r], drawn.proposal_logq[r], rtol=0,
                                  atol=1e-5)
        else:
            assert (mixed.proposal_logq[r] == NEG_INF).all()
    alone = draft_trees_per_request(tree_kind, roots, pools, budget, [False] * R, None, **extra)
    for f in fields(DraftTree):
        x, y = getattr(alone, f.name), getattr(plain, f.name)
        assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
    with pytest.raises(ValueError, match="sampled trees need seeds"):
        draft_trees_per_request(tree_kind, roots, pools, budget, sampled, None, **extra)
    with pytest.raises(ValueError, match="one flag per request"):
        draft_trees_per_request(tree_kind, roots, pools, budget, sampled[:2], seeds, **extra)
    with pytest.raises(ValueError, match=r"sampled trees exist for tree in \['weaver', 'ddtree'\]"):
        draft_trees("chain", roots, pools, budget, sample_seeds=seeds)


# -- DraftTree helpers ----------------------------------------------------------------

def test_children_select_truncate_and_metadata():
    gen = torch.Generator().manual_seed(12)
    roots, ids, logits = make_pools(gen, 3, 4, 5, 40)
    tree = build_ddtree(roots, ids, logits, 11)
    children, counts = tree.children()
    for r in range(3):
        for v in range(tree.max_nodes):
            want = [i for i in range(1, int(tree.num_nodes[r])) if int(tree.parents[r, i]) == v]
            got = children[r, v][children[r, v] >= 0].tolist()
            assert got == want and int(counts[r, v]) == len(want)
            assert (children[r, v, len(want):] == -1).all()
    sub = tree.select(torch.tensor([2, 0]))
    assert torch.equal(sub.tokens, tree.tokens[[2, 0]])
    cut = tree.truncate(torch.tensor([1, 5, 100], dtype=torch.int32))
    cut.validate()
    assert cut.num_nodes.tolist() == [1, 5, int(tree.num_nodes[2])]
    assert torch.equal(cut.tokens[1, :5], tree.tokens[1, :5]) and (cut.tokens[1, 5:] == 0).all()
    meta = cut.to_metadata(conv_width=3)
    assert meta.conv_width == 3 and torch.equal(meta.parents, cut.parents)
    sampled = build_sampled_tree(roots, ids, logits, 11, torch.tensor([1, 2, 3]))
    cut = sampled.truncate(torch.tensor([2, 2, 2]))
    cut.validate()
    assert (cut.proposal_logq[:, 2:] == NEG_INF).all()
    only_root = build_chain(roots, ids, logits, 0)
    kids, counts = only_root.children()
    assert kids.shape == (3, 1, 0) and (counts == 0).all()


# -- bad input ------------------------------------------------------------------------

def test_bad_inputs_name_the_field():
    gen = torch.Generator().manual_seed(2)
    roots, ids, logits = make_pools(gen, 2, 3, 4, 20)
    session = FakeSession(ids, logits, 20, gen, ties=False)
    seeds = torch.tensor([1, 2])
    nan_logits = logits.masked_fill(logits > 0, float("nan"))
    dead_row = logits.index_fill(2, torch.arange(4), NEG_INF)
    twice = ids.index_fill(2, torch.tensor([1]), int(ids[0, 0, 0]))
    bad_session = type("S", (), {"expand": lambda self, n, t, p, d: torch.zeros(2, 1, 3)})()
    cases = [
        ("pool_ids", lambda: build_ddtree(roots, ids.int(), logits, 4)),
        ("pool_ids", lambda: build_chain(roots, ids[0], logits, 4)),
        ("root_tokens", lambda: build_ddtree(roots[:1], ids, logits, 4)),
        ("root_tokens", lambda: build_chain(roots.int(), ids, logits, 4)),
        ("pool_logits", lambda: build_ddtree(roots, ids, logits[:, :2], 4)),
        ("pool_logits", lambda: build_ddtree(roots, ids, nan_logits, 4)),
        ("pool_logits", lambda: build_chain(roots, ids, dead_row, 4)),
        ("pool_ids", lambda: build_ddtree(roots, twice, logits, 4)),
        ("budget", lambda: build_ddtree(roots, ids, logits, -1)),
        ("budget", lambda: build_chain(roots, ids, logits, 2.5)),
        ("fanout", lambda: build_weaver_tree(roots, ids, session, 4, fanout=0)),
        ("max_depth", lambda: build_weaver_tree(roots, ids, session, 4, max_depth=4)),
        ("expand_width", lambda: build_weaver_tree(roots, ids, session, 4, expand_width=0)),
        ("seeds", lambda: build_sampled_tree(roots, ids, logits, 4, seeds.int())),
        ("first_exponent", lambda: build_sampled_tree(roots, ids, logits, 4, seeds,
                                                      first_exponent=0.0)),
        ("session.expand", lambda: build_weaver_tree(roots, ids, bad_session, 4)),
    ]
    for field, call in cases:
        with pytest.raises(ValueError, match=field.replace(".", r"\.")):
            call()
    tree = build_ddtree(roots, ids, logits, 4)
    base = {f.name: getattr(tree, f.name) for f in fields(tree)}
    for name, value in [
        ("parents", tree.parents.long()),
        ("depths", tree.depths[:, :2]),
        ("num_nodes", tree.num_nodes.long()),
        ("max_depth", -1),
        ("pool_ids", ids),  # without proposal_logq
    ]:
        with pytest.raises(ValueError, match=name):
            DraftTree(**{**base, name: value})
    deep = DraftTree(**{**base, "max_depth": 0})
    with pytest.raises(ValueError, match="depths"):
        deep.validate()


def test_sampled_trees_build_without_host_reads(monkeypatch):
    """The graph-ready builds: DDTree's sampled tree with every depth's draws at its
    largest width, the same tree as the build that reads the widths back; Weaver's
    sampled tree (its pops are fixed by the budget) reads nothing back either."""
    from host_reads import no_host_reads, run_as_on_cuda

    cfg = WeaverConfig(d_model=32, d_embed=24, d_rank=16, num_layers=1, num_heads=2, mlp_dim=20,
                       K=5, candidate_pool_size=8, layout="learned_pos", extra={})
    weaver = random_weaver(cfg, seed=5)
    gen = torch.Generator().manual_seed(12)
    V, R, D, P, budget = 60, 3, 5, 8, 12
    weaver.prepare_tables(torch.randn(V, 24, generator=gen), torch.randn(V, 32, generator=gen) / 4)
    roots, ids, logits = make_pools(gen, R, D, P, V)
    h_v, hidden = torch.randn(R, 32, generator=gen), torch.randn(R, D, 32, generator=gen)
    seeds = torch.tensor([7, 8, 9])

    run_as_on_cuda(monkeypatch)
    read_back = build_sampled_tree(roots, ids, logits, budget, seeds, validate=False)
    with no_host_reads():
        fixed = build_sampled_tree(roots, ids, logits, budget, seeds, validate=False,
                                   fixed_widths=True)
        session = weaver.start_round(h_v, hidden, ids, logits * 3, max_nodes=budget + 1,
                                     validate=False)
        weaver_tree = build_weaver_tree(roots, ids, session, budget, validate=False,
                                        seeds=seeds)
    assert weaver_tree.sampled
    for f in fields(DraftTree):
        x = getattr(read_back, f.name)
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, getattr(fixed, f.name)), f.name
    assert sampled_call_widths(12, 5, 8) == [1, 8, 10, 9, 8]
    assert sampled_call_widths(2, 4, 3) == [1, 1, 0, 0]
