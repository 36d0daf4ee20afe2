"""Verifiers: exactness by enumeration, greedy walk, reproducibility, bad input.

Exactness: on tiny vocabularies every outcome of a verifier (accepted path +
bonus) is enumerated with its probability, using the verifier's own decision
functions with controlled randomness (``target_only_plan`` or ``traversal_plan``,
then ``walk_plan``); each enumerated outcome is then
replayed through the batched walk with crafted uniforms. Extended to a fixed
horizon by target sampling, the law of the output sequence must equal the
target's multi-step law to 1e-10.
"""

import itertools
import math
from dataclasses import fields

import pytest
import torch

from triton_ops.tree_metadata import root_to_node_path
from triton_ops.counter_random import counter_gumbel, counter_uniform
from vllm_tfm.drafting.builders import SAMPLED_FIRST_RANK_EXPONENT
from vllm_tfm.drafting.tree import DraftTree, derive_seeds
from vllm_tfm.drafting.verifiers import (
    ORDER_STREAM,
    TraversalPlan,
    _finish,
    target_only_plan,
    traversal_plan,
    walk_plan,
    verify_greedy,
    verify_target_only,
    verify_traversal,
)

F64 = torch.float64
TOL = 1e-10


# -- a target (and draft) "model": a deterministic law per context ------------------

class ContextLaw:
    """next-token law of a context tuple, fixed by (seed, kind); float64 [V]."""

    def __init__(self, vocab: int, seed: int, kind: str):
        self.vocab, self.seed, self.kind = vocab, seed, kind
        self.cache: dict[tuple, torch.Tensor] = {}

    def __call__(self, context: tuple) -> torch.Tensor:
        if context not in self.cache:
            h = self.seed
            for t in context:
                h = (h * 1000003 + t + 7) % (1 << 61)
            g = torch.Generator().manual_seed(h)
            scale = {"smooth": 1.0, "peaky": 4.0, "zeros": 1.5, "onehot": 1.0}[self.kind]
            logits = torch.randn(self.vocab, generator=g, dtype=F64) * scale
            law = torch.softmax(logits, 0)
            if self.kind == "zeros":
                keep = torch.rand(self.vocab, generator=g) < 0.6
                keep[int(torch.randint(0, self.vocab, (1,), generator=g))] = True
                law = torch.where(keep, law, 0.0)
                law = law / law.sum()
            elif self.kind == "onehot":
                law = torch.nn.functional.one_hot(law.argmax(), self.vocab).to(F64)
            self.cache[context] = law
        return self.cache[context]


def target_sequence_law(law: ContextLaw, root: int, horizon: int) -> dict[tuple, float]:
    out = {}
    for seq in itertools.product(range(law.vocab), repeat=horizon):
        p = 1.0
        for k in range(horizon):
            p *= float(law((root,) + seq[:k])[seq[k]])
            if p == 0.0:
                break
        out[seq] = p
    return out


def extend_to_horizon(law: ContextLaw, root: int, outcomes: dict[tuple, float], horizon: int):
    """Continue each output by target sampling to ``horizon`` tokens."""
    out = {seq: 0.0 for seq in itertools.product(range(law.vocab), repeat=horizon)}
    for prefix, weight in outcomes.items():
        for rest in itertools.product(range(law.vocab), repeat=horizon - len(prefix)):
            p = weight
            for k in range(len(rest)):
                p *= float(law((root,) + prefix + rest[:k])[rest[k]])
            out[prefix + rest] += p
    return out


def assert_lossless(law: ContextLaw, root: int, outcomes: dict[tuple, float], horizon: int):
    assert abs(sum(outcomes.values()) - 1.0) < TOL
    got = extend_to_horizon(law, root, outcomes, horizon)
    want = target_sequence_law(law, root, horizon)
    err = max(abs(got[s] - want[s]) for s in want)
    assert err < TOL, f"max law error {err:.3e}"


# -- trees -------------------------------------------------------------------------

SHAPES = {
    "root": [-1],
    "chain": [-1, 0, 1, 2],
    "star": [-1, 0, 0, 0],
    "bushy": [-1, 0, 0, 1, 1, 2],
    "mixed": [-1, 0, 0, 1, 3, 1, 2],
}


def depths_of(parents):
    return [len(root_to_node_path(parents, i)) - 1 for i in range(len(parents))]


def make_tree(parents, vocab, gen, logq_kind="random"):
    """One deterministic tree (R = 1): distinct sibling tokens, random draft log q."""
    n = len(parents)
    tokens = [int(torch.randint(0, vocab, (1,), generator=gen))]
    for i in range(1, n):
        used = {tokens[j] for j in range(1, i) if parents[j] == parents[i]}
        free = [t for t in range(vocab) if t not in used]
        tokens.append(free[int(torch.randint(0, len(free), (1,), generator=gen))])
    logq = (torch.rand(n, generator=gen, dtype=F64) * 3 - 3).float()
    logq[0] = 0.0
    if logq_kind == "zero_child":
        logq[n - 1] = float("-inf")
    return DraftTree(
        tokens=torch.tensor([tokens]),
        parents=torch.tensor([parents], dtype=torch.int32),
        depths=torch.tensor([depths_of(parents)], dtype=torch.int32),
        num_nodes=torch.tensor([n], dtype=torch.int32),
        draft_logq=logq[None],
        max_depth=max(depths_of(parents)) + 1,
    )


def contexts(tree: DraftTree, r: int = 0) -> list[tuple]:
    out = []
    for i in range(int(tree.num_nodes[r])):
        p = int(tree.parents[r, i])
        out.append((out[p] if p >= 0 else ()) + (int(tree.tokens[r, i]),))
    return out


def target_probs(tree: DraftTree, law: ContextLaw) -> torch.Tensor:
    ctx = contexts(tree)
    probs = torch.full((1, tree.max_nodes, law.vocab), float("nan"), dtype=F64)
    for i, c in enumerate(ctx):
        probs[0, i] = law(c)
    return probs


def replicate(tree: DraftTree, rows: int) -> DraftTree:
    return tree.select(torch.zeros(rows, dtype=torch.int64))


def concat_trees(trees: list[DraftTree]) -> DraftTree:
    """Requests of equal N stacked into one batch."""
    return DraftTree(**{
        f.name: (
            torch.cat([getattr(t, f.name) for t in trees])
            if isinstance(getattr(trees[0], f.name), torch.Tensor)
            else getattr(trees[0], f.name)
        )
        for f in fields(DraftTree)
    })


def plan_row(plan: TraversalPlan, row: int) -> TraversalPlan:
    """One request of a batched plan, so plans are computed for many trees at once."""
    index = torch.tensor([row])
    return TraversalPlan(**{f.name: getattr(plan, f.name).index_select(0, index)
                            for f in fields(TraversalPlan)})


def midpoint(weights: torch.Tensor, index: int) -> float:
    cdf = weights.cumsum(0)
    lo = 0.0 if index == 0 else float(cdf[index - 1])
    return (lo + float(cdf[index])) / 2 / float(cdf[-1])


def output_of(tree, path_nodes, bonus):
    return tuple(int(tree.tokens[0, i]) for i in path_nodes[1:]) + (bonus,)


def add_outcomes(outcomes, tree, cases, scale=1.0):
    """Add each enumerated case's weight (times ``scale``) to the law of its output
    tokens; ``outcomes`` maps output tuples to probabilities."""
    for path, bonus, weight, *_ in cases:
        key = output_of(tree, path, bonus)
        outcomes[key] = outcomes.get(key, 0.0) + weight * scale
    return outcomes


def check_replay(tree, probs, walk, cases):
    """Replay enumerated cases (expected path, bonus, uniforms) through a batched walk."""
    rows = len(cases)
    result = walk(replicate(tree, rows), probs.expand(rows, -1, -1), cases)
    for row, (path_nodes, bonus, *_rest) in enumerate(cases):
        assert int(result.accepted_leaf[row]) == path_nodes[-1]
        assert int(result.accepted_len[row]) == len(path_nodes) - 1
        assert result.path[row, : len(path_nodes)].tolist() == path_nodes
        assert (result.path[row, len(path_nodes):] == -1).all()
        assert int(result.bonus_token[row]) == bonus
        out = output_of(tree, path_nodes, bonus)
        assert result.output_tokens[row, : len(out)].tolist() == list(out)
        assert (result.output_tokens[row, len(out):] == -1).all()


# -- target-only --------------------------------------------------------------------

def enumerate_target_only(tree, probs):
    return enumerate_plan(tree, probs, target_only_plan(tree, probs))


def run_target_only_cases(tree, probs, cases, backend="torch"):
    return run_plan_cases(tree, probs, target_only_plan(tree, probs), cases, backend)


KINDS = ("smooth", "peaky", "zeros", "onehot")
# "triton": the walk and the traversal sweeps as kernels (triton_ops.traversal), in the
# interpreter.
BACKENDS = ("torch", "triton")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("vocab", [3, 4])
def test_target_only_is_lossless(shape, kind, vocab, backend, gen):
    tree = make_tree(SHAPES[shape], vocab, gen)
    law = ContextLaw(vocab, int(torch.randint(0, 1 << 30, (1,), generator=gen)), kind)
    probs = target_probs(tree, law)
    cases = enumerate_target_only(tree, probs)
    check_replay(tree, probs, lambda t, p, c: run_target_only_cases(t, p, c, backend), cases)
    assert_expected_accepted(tree, target_only_plan(tree, probs), cases)
    outcomes = add_outcomes({}, tree, cases)
    root = int(tree.tokens[0, 0])
    assert_lossless(law, root, outcomes, max(depths_of(SHAPES[shape])) + 1)


# -- traversal ----------------------------------------------------------------------

def enumerate_plan(tree, probs, plan):
    """Every (path, bonus) of a plan with its probability and the uniforms that pick it."""
    K = plan.children.shape[2]
    cases = []

    def visit(node, path, weight, uniforms):
        choice = plan.choice[0, node]
        assert abs(float(choice.sum()) - 1.0) < 1e-9
        for j in range(K + 1):
            if choice[j] <= 0:
                continue
            u = dict(uniforms)
            u[node] = midpoint(choice, j)
            w = weight * float(choice[j] / choice.sum())
            if j < K:
                child = int(plan.children[0, node, j])
                assert child >= 0
                visit(child, path + [child], w, u)
                continue
            law = plan.bonus_distribution(probs, torch.tensor([node]))[0]
            assert abs(float(law.sum()) - 1.0) < 1e-9, (float(choice[j]), choice.tolist(), law.tolist())
            for b in range(law.shape[0]):
                if law[b] > 0:
                    cases.append((path, b, w * float(law[b] / law.sum()), u, midpoint(law, b)))

    visit(0, [0], 1.0, {})
    return cases


def assert_expected_accepted(tree, plan, cases):
    """The plan's E[accepted] (what tools/compare_trees.py reports) is its enumerated law's."""
    want = sum(weight * (len(path) - 1) for path, _, weight, _, _ in cases)
    assert abs(float(plan.expected_accepted(tree.max_depth)[0]) - want) < 1e-10


def run_plan_cases(tree, probs, plan, cases, backend="torch"):
    rows = len(cases)
    choice_u = torch.full((rows, tree.max_nodes), 0.5, dtype=F64)
    bonus_u = torch.empty(rows, dtype=F64)
    for row, (_, _, _, u, ub) in enumerate(cases):
        for node, value in u.items():
            choice_u[row, node] = value
        bonus_u[row] = ub
    wide = type(plan)(**{
        f.name: getattr(plan, f.name).index_select(0, torch.zeros(rows, dtype=torch.int64))
        for f in fields(plan)
    })
    return walk_plan(tree, wide, probs, choice_u, bonus_u, backend)


def sibling_orders(tree):
    """All visiting orders of every node's children, with their w/o-replacement
    probability under q restricted to the siblings (zero-mass children last,
    in node order, as the verifier's stable sort leaves them)."""
    n = int(tree.num_nodes[0])
    kids = {v: [i for i in range(1, n) if int(tree.parents[0, i]) == v] for v in range(n)}
    per_node = []
    for v, ch in kids.items():
        if len(ch) < 2:
            continue
        q = torch.exp(tree.draft_logq[0, ch].double())
        options = []
        for perm in itertools.permutations(range(len(ch))):
            positive = [k for k in perm if q[k] > 0]
            zero = [k for k in perm if q[k] == 0]
            if list(perm) != positive + zero or zero != sorted(zero):
                continue
            p, left = 1.0, float(q.sum())
            for k in positive:
                p *= float(q[k]) / left
                left -= float(q[k])
            options.append(([ch[k] for k in perm], p))
        per_node.append(options)
    for combo in itertools.product(*per_node):
        keys = torch.zeros(1, tree.max_nodes, dtype=F64)
        weight = 1.0
        for order, p in combo:
            weight *= p
            for rank, node in enumerate(order):
                keys[0, node] = -rank
        yield keys, weight


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("vocab,logq_kind", [(3, "random"), (4, "random"), (4, "zero_child")])
def test_traversal_deterministic_tree_is_lossless(shape, kind, vocab, logq_kind, backend, gen):
    tree = make_tree(SHAPES[shape], vocab, gen, logq_kind)
    law = ContextLaw(vocab, int(torch.randint(0, 1 << 30, (1,), generator=gen)), kind)
    probs = target_probs(tree, law)
    orders = list(sibling_orders(tree))
    keys = torch.cat([k for k, _ in orders])
    # All visiting orders in one batched plan.
    plans = traversal_plan(replicate(tree, len(orders)), probs.expand(len(orders), -1, -1), keys,
                           backend)
    outcomes = {}
    for row, (_, order_weight) in enumerate(orders):
        plan = plan_row(plans, row)
        assert abs(float(plan.accept[0, 0]) - 1.0) < 1e-12
        cases = enumerate_plan(tree, probs, plan)
        check_replay(tree, probs, lambda t, p, c: run_plan_cases(t, p, plan, c, backend),
                     cases)
        assert_expected_accepted(tree, plan, cases)
        for path, bonus, weight, _, _ in cases:
            # On a deterministic tree a drawn child token is always accepted.
            leaf_children = [
                int(tree.tokens[0, i]) for i in range(1, tree.max_nodes)
                if int(tree.parents[0, i]) == path[-1] and tree.draft_logq[0, i] > float("-inf")
            ]
            # (Rounding leaves the residual law ~1e-17 on a rejected token.)
            assert bonus not in leaf_children or weight < 1e-12, (path, bonus, weight)
        add_outcomes(outcomes, tree, cases, order_weight)
    assert_lossless(law, int(tree.tokens[0, 0]), outcomes, max(depths_of(SHAPES[shape])) + 1)


SAMPLED_SHAPES = {
    "chain": [-1, 0, 1],
    "star": [-1, 0, 0],
    "bushy": [-1, 0, 0, 1, 1, 2],
    "deep": [-1, 0, 1, 1, 2],
}


def sampled_trees(parents, pool_ids, draft, root):
    """Every realisation of a sampled tree of this shape, with its probability.

    ``draft(context)`` gives float32 log q over the pool row of the context's
    last node; the law drawn from is its float64 softmax, as in the builder.
    Children of node u are an ordered draw without replacement from it; once
    its mass is spent the remaining slots take the zero-mass ids in pool
    order, as the builder's stable sort does.
    """
    n = len(parents)
    depths = depths_of(parents)
    kids = {v: [i for i in range(1, n) if parents[i] == v] for v in range(n)}
    D, P = pool_ids.shape
    internal = [v for v in range(n) if kids[v]]

    def draws(q, k, taken=()):
        if k == 0:
            yield [], 1.0
            return
        mass = float(q.sum())
        if mass == 0:
            yield [i for i in range(P) if i not in taken][:k], 1.0
            return
        for i in range(P):
            if q[i] > 0:
                rest = q.clone()
                rest[i] = 0
                for tail, p in draws(rest, k - 1, taken + (i,)):
                    yield [i] + tail, float(q[i]) / mass * p

    def realise(index, tokens, weight):
        if index == len(internal):
            yield list(tokens), weight
            return
        v = internal[index]
        q = torch.softmax(draft(tuple(tokens[j] for j in root_to_node_path(parents, v))).double(), 0)
        for picks, p in draws(q, len(kids[v])):
            for child, pos in zip(kids[v], picks):
                tokens[child] = int(pool_ids[depths[v], pos])
            yield from realise(index + 1, tokens, weight * p)

    for tokens, weight in realise(0, [root] + [0] * (n - 1), 1.0):
        proposal = torch.full((1, n, P), float("-inf"))
        logq = torch.zeros(1, n)
        for v in range(n):
            row = draft(tuple(tokens[j] for j in root_to_node_path(parents, v)))
            if kids[v]:
                proposal[0, v] = row
            for child in kids[v]:
                pos = int((pool_ids[depths[v]] == tokens[child]).nonzero()[0, 0])
                logq[0, child] = row[pos]
        yield DraftTree(
            tokens=torch.tensor([tokens]),
            parents=torch.tensor([parents], dtype=torch.int32),
            depths=torch.tensor([depths], dtype=torch.int32),
            num_nodes=torch.tensor([n], dtype=torch.int32),
            draft_logq=logq,
            max_depth=D,
            pool_ids=pool_ids[None],
            proposal_logq=proposal,
        ), weight


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", list(SAMPLED_SHAPES))
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("vocab,pool", [(3, 3), (5, 3)])
def test_traversal_sampled_tree_is_lossless(shape, kind, vocab, pool, backend, gen):
    """Exact over the tree's draws too: pools smaller than the vocabulary put
    target mass off the proposal's support; the draft law has zero-mass ids."""
    parents = SAMPLED_SHAPES[shape]
    D = max(depths_of(parents)) + 1
    pool_ids = torch.stack([torch.randperm(vocab, generator=gen)[:pool] for _ in range(D)])
    law = ContextLaw(vocab, int(torch.randint(0, 1 << 30, (1,), generator=gen)), kind)
    draft_full = ContextLaw(vocab, int(torch.randint(0, 1 << 30, (1,), generator=gen)), "zeros")

    def draft(ctx):  # log q over the pool row of a depth-(len(ctx) - 1) node
        q = draft_full(ctx)[pool_ids[len(ctx) - 1]]
        if q.sum() == 0:
            q = torch.ones_like(q)
        return torch.log(q / q.sum()).float()

    root = int(torch.randint(0, vocab, (1,), generator=gen))
    realised = list(sampled_trees(parents, pool_ids, draft, root))
    batch = concat_trees([t for t, _ in realised])
    batch.validate(vocab_size=vocab)
    all_probs = torch.cat([target_probs(t, law) for t, _ in realised])
    plans = traversal_plan(batch, all_probs, backend=backend)  # every realisation at once
    outcomes, total = {}, 0.0
    for row, (tree, tree_weight) in enumerate(realised):
        total += tree_weight
        probs, plan = all_probs[row : row + 1], plan_row(plans, row)
        assert abs(float(plan.accept[0, 0]) - 1.0) < 1e-12
        cases = enumerate_plan(tree, probs, plan)
        check_replay(tree, probs, lambda t, p, c: run_plan_cases(t, p, plan, c, backend),
                     cases)
        assert_expected_accepted(tree, plan, cases)
        add_outcomes(outcomes, tree, cases, tree_weight)
    assert abs(total - 1.0) < 1e-12
    assert_lossless(law, root, outcomes, max(depths_of(parents)) + 1)


@pytest.mark.parametrize("sampled", [True, False])
def test_traversal_reads_nothing_back_from_the_device(sampled, gen):
    """No host read (each would be a device sync on CUDA): the plan's loops come from the
    trees' shapes only, sampled trees and deterministic ones (sibling order drawn)."""
    from host_reads import HostRead, no_host_reads

    parents = SAMPLED_SHAPES["bushy"]
    vocab, pool = 5, 3
    pool_ids = torch.stack([torch.randperm(vocab, generator=gen)[:pool] for _ in range(3)])
    draft = ContextLaw(vocab, 3, "smooth")
    tree, _ = next(sampled_trees(parents, pool_ids, lambda c: torch.log(
        draft(c)[pool_ids[len(c) - 1]]).float(), 0))
    if not sampled:
        tree = DraftTree(**{**{f.name: getattr(tree, f.name) for f in fields(tree)},
                            "pool_ids": None, "proposal_logq": None})
    batch = replicate(tree, 3)
    probs = target_probs(tree, ContextLaw(vocab, 4, "peaky")).nan_to_num(0.2).expand(3, -1, -1)
    seeds = torch.tensor([1, 2, 3])
    with no_host_reads():
        with pytest.raises(HostRead):
            tree.validate()  # the guard is live
        result = verify_traversal(batch, probs, seeds, validate=False)
    assert torch.equal(result.output_tokens, verify_traversal(batch, probs, seeds).output_tokens)


def test_traversal_beats_target_only_on_sampled_chain():
    """The reason traversal exists: on a chain drawn from q = p it accepts
    every token, while target-only accepts a drawn token with prob p(x)."""
    vocab = 4
    law = ContextLaw(vocab, 11, "smooth")
    pool_ids = torch.arange(vocab).expand(2, -1)
    accepted = {"traversal": 0.0, "target_only": 0.0}
    draft = lambda c: torch.log(law(c)).float()  # noqa: E731  (q = p up to float32)
    for tree, weight in sampled_trees([-1, 0, 1], pool_ids, draft, 0):
        probs = target_probs(tree, law)
        plan = traversal_plan(tree, probs)
        for path, _, w, _, _ in enumerate_plan(tree, probs, plan):
            accepted["traversal"] += weight * w * (len(path) - 1)
        for path, _, w, *_ in enumerate_target_only(tree, probs):
            accepted["target_only"] += weight * w * (len(path) - 1)
    assert abs(accepted["traversal"] - 2.0) < 1e-5
    assert accepted["target_only"] < 1.5


# -- the production randomness, statistically --------------------------------------

def frequencies(results: list[tuple]) -> dict[tuple, int]:
    out = {}
    for r in results:
        out[r] = out.get(r, 0) + 1
    return out


def assert_close_in_law(counts: dict, law: dict, n: int):
    """Every outcome's frequency within 5 standard errors (+ slack) of its law."""
    for key in set(counts) | set(law):
        p = law.get(key, 0.0)
        f = counts.get(key, 0) / n
        assert p > 0 or f == 0, f"outcome {key} has probability 0 but was drawn"
        assert abs(f - p) <= 5 * math.sqrt(p * (1 - p) / n) + 2 / n, (key, f, p)


@pytest.mark.parametrize("verifier", ["target_only", "traversal"])
def test_seeded_verifiers_match_their_law(verifier, gen):
    vocab, n = 4, 20000
    tree = make_tree(SHAPES["mixed"], vocab, gen)
    law = ContextLaw(vocab, 99, "smooth")
    probs = target_probs(tree, law)
    big = replicate(tree, n)
    seeds = torch.arange(n, dtype=torch.int64) * 7919 + 3
    fn = verify_target_only if verifier == "target_only" else verify_traversal
    result = fn(big, probs.expand(n, -1, -1), seeds)
    counts = frequencies([
        tuple(row[row >= 0].tolist()) for row in result.output_tokens
    ])
    if verifier == "target_only":
        cases = [(c[0], c[1], c[2]) for c in enumerate_target_only(tree, probs)]
    else:
        cases = []
        for keys, w in sibling_orders(tree):
            plan = traversal_plan(tree, probs, keys)
            cases += [(c[0], c[1], c[2] * w) for c in enumerate_plan(tree, probs, plan)]
    exact = add_outcomes({}, tree, cases)
    assert_close_in_law(counts, exact, n)


def test_sibling_order_keys_sample_without_replacement():
    n = 40000
    logq = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=F64))
    seeds = torch.arange(n, dtype=torch.int64) + 17
    keys = logq + counter_gumbel(seeds, ORDER_STREAM, torch.arange(4).expand(n, -1))
    counts = frequencies([tuple(r) for r in keys.argsort(-1, descending=True)[:, :2].tolist()])
    q = logq.exp().tolist()
    law = {(a, b): q[a] * q[b] / (1 - q[a]) for a in range(4) for b in range(4) if a != b}
    assert_close_in_law(counts, law, n)


def test_counter_uniform_is_uniform_and_independent():
    n = 200000
    u = counter_uniform(torch.tensor([5, 6]), 3, torch.arange(n).expand(2, -1))
    assert u.dtype == F64 and (u >= 0).all() and (u < 1).all()
    assert abs(float(u.mean()) - 0.5) < 5 * (1 / math.sqrt(12 * n))
    bins = torch.histc(u[0].float(), bins=10, min=0, max=1) / n
    assert (bins - 0.1).abs().max() < 5 * math.sqrt(0.1 * 0.9 / n)
    assert abs(float(torch.corrcoef(u)[0, 1])) < 5 / math.sqrt(n)
    other_stream = counter_uniform(torch.tensor([5]), 4, torch.arange(10)[None])
    assert not torch.equal(other_stream, u[:1, :10])


# -- greedy -------------------------------------------------------------------------

@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("seed", range(4))
def test_greedy_is_the_argmax_walk(shape, seed, gen):
    vocab, R = 4, 6
    trees = [make_tree(SHAPES[shape], vocab, gen) for _ in range(R)]
    tree = concat_trees(trees)
    # Half the rows follow the tree as far as it goes: plant the child's token as argmax.
    target = torch.randn(R, tree.max_nodes, vocab, generator=gen)
    for r in range(0, R, 2):
        for i in range(1, tree.max_nodes):
            boost = 10.0 * (i == 1 or i % 2 == 1)
            target[r, int(tree.parents[r, i]), int(tree.tokens[r, i])] += boost
    result = verify_greedy(tree, target)
    for r in range(R):
        node = 0
        while True:
            x = int(target[r, node].argmax())
            nxt = [i for i in range(1, tree.max_nodes)
                   if int(tree.parents[r, i]) == node and int(tree.tokens[r, i]) == x]
            if not nxt:
                break
            node = nxt[0]
        assert int(result.accepted_leaf[r]) == node
        assert int(result.bonus_token[r]) == x
        assert int(result.accepted_len[r]) == int(tree.depths[r, node])
    # The path read off the chain of matches is the one walked up from the leaf.
    walked = _finish(tree, result.accepted_leaf, result.bonus_token)
    assert torch.equal(result.path, walked.path)
    assert torch.equal(result.output_tokens, walked.output_tokens)


# -- reproducibility and batching -------------------------------------------------

def mixed_batch(gen, vocab=4):
    """Three requests with different shapes and node counts, padded to one N."""
    shapes = [SHAPES["mixed"], SHAPES["star"], SHAPES["chain"]]
    trees = [make_tree(s, vocab, gen) for s in shapes]
    N = max(t.max_nodes for t in trees)

    def pad(t, name, fill):
        x = getattr(t, name)
        return torch.nn.functional.pad(x, (0, N - x.shape[1]), value=fill)

    tree = DraftTree(
        tokens=torch.cat([pad(t, "tokens", 0) for t in trees]),
        parents=torch.cat([pad(t, "parents", -1) for t in trees]),
        depths=torch.cat([pad(t, "depths", 0) for t in trees]),
        num_nodes=torch.cat([t.num_nodes for t in trees]),
        draft_logq=torch.cat([pad(t, "draft_logq", 0.0) for t in trees]),
        max_depth=max(t.max_depth for t in trees),
    )
    probs = torch.softmax(torch.randn(3, N, vocab, generator=gen, dtype=F64) * 2, -1)
    return tree, probs


@pytest.mark.parametrize("verifier", [verify_target_only, verify_traversal])
def test_seeds_reproduce_and_ignore_the_batch(verifier, gen):
    tree, probs = mixed_batch(gen)
    seeds = torch.tensor([11, 12, 13])
    first = verifier(tree, probs, seeds)
    again = verifier(tree, probs, seeds)
    for f in fields(first):
        assert torch.equal(getattr(first, f.name), getattr(again, f.name))
    # Request 2 alone, and requests (2, 0) reversed, give the same results.
    for rows in ([2], [2, 0]):
        idx = torch.tensor(rows)
        sub = verifier(tree.select(idx), probs[idx], seeds[idx])
        for f in fields(first):
            assert torch.equal(getattr(sub, f.name), getattr(first, f.name)[idx])
    # Fresh step seeds draw other numbers: over many steps the outputs vary.
    outs = {str(verifier(tree, probs, derive_seeds(seeds, step)).output_tokens.tolist())
            for step in range(40)}
    assert len(outs) > 1


def test_padding_rows_never_leak(gen):
    """Padding nodes hold NaN target rows: results must stay finite and in range."""
    tree, probs = mixed_batch(gen)
    probs = probs.masked_fill(~tree.valid[..., None], float("nan"))
    for result in (
        verify_target_only(tree, probs, torch.tensor([1, 2, 3])),
        verify_traversal(tree, probs, torch.tensor([1, 2, 3])),
        verify_greedy(tree, probs.nan_to_num(-1.0)),
    ):
        assert (result.accepted_leaf < tree.num_nodes.long()).all()
        assert ((result.bonus_token >= 0) & (result.bonus_token < 4)).all()
    plan = traversal_plan(tree, probs, tree.draft_logq.double())
    for name in ("alpha", "accept", "choice", "residual", "outside_scale"):
        value = getattr(plan, name)
        mask = tree.valid if value.dim() == 2 else tree.valid[..., None]
        assert not torch.isnan(value[mask.expand_as(value)]).any(), name


# -- bad input ------------------------------------------------------------------------

def test_bad_inputs_name_the_field(gen):
    tree, probs = mixed_batch(gen)
    seeds = torch.tensor([1, 2, 3])
    with pytest.raises(ValueError, match="probs"):
        verify_target_only(tree, probs[:, :2], seeds)
    with pytest.raises(ValueError, match="probs"):
        verify_traversal(tree, probs.long(), seeds)
    with pytest.raises(ValueError, match="target"):
        verify_greedy(tree, probs[0])
    with pytest.raises(ValueError, match="seeds"):
        verify_traversal(tree, probs, seeds.int())
    with pytest.raises(ValueError, match="seeds"):
        verify_target_only(tree, probs, seeds[:2])
    with pytest.raises(ValueError, match="tokens"):
        verify_greedy(tree, probs[..., :2])  # tokens beyond the vocabulary
    with pytest.raises(ValueError, match="sibling_keys"):
        traversal_plan(tree, probs, torch.zeros(2, 2))
    bad = DraftTree(**{**{f.name: getattr(tree, f.name) for f in fields(tree)},
                       "parents": tree.parents.clone().index_fill_(1, torch.tensor([2]), 5)})
    with pytest.raises(ValueError, match="parents"):
        verify_target_only(bad, probs, seeds)
    dup = tree.tokens.clone()
    dup[1, 2] = dup[1, 1]
    with pytest.raises(ValueError, match="tokens"):
        verify_traversal(DraftTree(**{**{f.name: getattr(tree, f.name) for f in fields(tree)},
                                      "tokens": dup}), probs, seeds)
    with pytest.raises(ValueError, match="draft_logq"):
        DraftTree(**{**{f.name: getattr(tree, f.name) for f in fields(tree)},
                     "draft_logq": tree.draft_logq.double()})


# -- the engine's sampled-tree path ---------------------------------------------------

def plackett_luce_weight(tree: DraftTree, r: int) -> float:
    """Probability that the builder draws row r's children: at each expanded node an
    ordered draw without replacement from softmax(proposal_logq) over its pool row;
    once the row's mass is spent the remaining slots are filled deterministically."""
    weight = 1.0
    children, _ = tree.children()
    for u in range(int(tree.num_nodes[r])):
        kids = [c for c in children[r, u].tolist() if c >= 0]
        if not kids:
            continue
        q = torch.softmax(tree.proposal_logq[r, u].double(), 0)
        row = tree.pool_ids[r, int(tree.depths[r, u])]
        undrawn = torch.ones_like(q, dtype=torch.bool)
        for c in kids:
            slot = int((row == tree.tokens[r, c]).nonzero()[0, 0])
            left = float(q[undrawn].sum())
            if left > 0:
                weight *= float(q[slot]) / left
            undrawn[slot] = False
    return weight


def tiny_weaver(vocab: int, gen):
    from vllm_tfm.drafting.weaver import WeaverConfig
    from vllm_tfm.drafting.weaver_checkpoint import random_weaver

    cfg = WeaverConfig(d_model=32, d_embed=24, d_rank=16, num_layers=1, num_heads=2, mlp_dim=20,
                       K=4, candidate_pool_size=8, layout="learned_pos", extra={})
    weaver = random_weaver(cfg, seed=int(torch.randint(0, 1000, (1,), generator=gen)))
    # A small head keeps q diffuse, so a few thousand seeds draw every realisation.
    weaver.prepare_tables(torch.randn(vocab, 24, generator=gen),
                          torch.randn(vocab, 32, generator=gen) / 8)
    return weaver


@pytest.mark.parametrize("tree_kind", ["ddtree", "weaver"])
@pytest.mark.parametrize("kind", ["smooth", "peaky", "zeros"])
def test_engine_sampled_trees_with_traversal_are_lossless(tree_kind, kind, gen):
    """The proposer's own call (``draft_trees_per_request``, sampled rows, as the
    engine makes it) at tiny sizes: its trees for many seeds are every realisation of
    the draw (their probabilities sum to 1), and the realisations' traversal outcomes,
    weighted by those probabilities, follow the target's multi-step law to 1e-10."""
    from vllm_tfm.drafting.draft_round import CandidatePools, draft_trees_per_request

    V, D, P, budget, count = 5, 2, 3, 3, 30000
    pool_ids = torch.stack([torch.randperm(V, generator=gen)[:P] for _ in range(D)])
    scores = torch.randn(D, P, generator=gen)
    pools = CandidatePools(pool_ids.expand(count, -1, -1), scores.expand(count, -1, -1))
    root = int(torch.randint(0, V, (1,), generator=gen))
    roots = torch.full((count,), root, dtype=torch.int64)
    weaver = h_v = hidden = None
    if tree_kind == "weaver":
        weaver = tiny_weaver(V, gen)
        h_v = torch.randn(1, 32, generator=gen).expand(count, -1)
        hidden = torch.randn(1, D, 32, generator=gen).expand(count, -1, -1)
    seeds = torch.arange(count, dtype=torch.int64) * 7919 + 3
    trees = draft_trees_per_request(tree_kind, roots, pools, budget, [True] * count, seeds,
                                    weaver=weaver, h_v=h_v, dflash_hidden=hidden,
                                    validate=False)
    assert trees.sampled
    assert_sampled_trees_lossless(trees, ContextLaw(
        V, int(torch.randint(0, 1 << 30, (1,), generator=gen)), kind), root)


def assert_sampled_trees_lossless(trees: DraftTree, law: ContextLaw, root: int) -> DraftTree:
    """``trees``: one request's sampled trees drawn with many seeds. Their distinct
    realisations must hold all the draw's mass, and their traversal outcomes, weighted by
    it, follow ``law``'s multi-step law to 1e-10. Returns the realisations."""
    trees.validate(vocab_size=law.vocab)
    distinct = {}
    for r, row in enumerate(trees.tokens.tolist()):
        distinct.setdefault(tuple(row), r)
    realised = trees.select(torch.tensor(sorted(distinct.values())))
    weights = [plackett_luce_weight(realised, r) for r in range(realised.batch_size)]
    assert abs(sum(weights) - 1.0) < TOL, f"realisations seen hold mass {sum(weights)}"
    outcomes = {}
    for r, tree_weight in enumerate(weights):
        tree = realised.select(torch.tensor([r]))
        probs = target_probs(tree, law)
        plan = traversal_plan(tree, probs)
        cases = enumerate_plan(tree, probs, plan)
        check_replay(tree, probs, lambda t, p, c: run_plan_cases(t, p, plan, c), cases)
        add_outcomes(outcomes, tree, cases, tree_weight)
    assert_lossless(law, root, outcomes, int(realised.depths.max()) + 1)
    return realised


# -- Weaver's best-first sampled tree, by exact enumeration of its draws --------------

class _MoreDraws(Exception):
    """The build asked for a draw beyond the enumerated prefix."""


def ordered_draw_probability(order, q) -> float:
    """Probability that a Gumbel-top-k draw from ``q`` orders the pool positions as
    ``order``: the Plackett-Luce product; zero-mass positions come last, by index."""
    weight, rest = 1.0, list(order)
    for pos in order:
        mass = float(sum(q[i] for i in rest))
        if mass > 0:
            weight *= float(q[pos]) / mass
        elif pos != min(rest):
            return 0.0
        rest.remove(pos)
    return weight


def every_draw(build, pool: int):
    """``build(draw)`` for every sequence of draw orders it asks for (each ``draw(i, row)``
    answered with a permutation of the pool), with the sequence's probability."""
    pending = [[]]
    while pending:
        prefix = pending.pop()
        rows = []

        def draw(i, row, prefix=prefix, rows=rows):
            rows.append(torch.softmax(torch.from_numpy(row).double(), 0))
            if len(rows) > len(prefix):
                raise _MoreDraws
            return list(prefix[len(rows) - 1])

        try:
            result = build(draw)
        except _MoreDraws:
            for order in itertools.permutations(range(pool)):
                if ordered_draw_probability(order, rows[-1]) > 0:
                    pending.append(prefix + [order])
            continue
        weight = math.prod(ordered_draw_probability(o, q) for o, q in zip(prefix, rows))
        yield result, weight


def sampled_weaver_law(session, root, ids, budget, width, fanout, first_exponent, law):
    """Traversal's outcomes over every realisation of the best-first sampled tree (the brute
    force that ``test_tree_builders`` holds the builder to, draw for draw), each weighted by
    its draws' probability; and the shapes (parent lists) the realisations took."""
    from test_tree_builders import brute_weaver

    _, D, P = ids.shape
    realised, shapes = {}, set()
    for rows, weight in every_draw(lambda draw: brute_weaver(
            session, 0, root, ids[0], budget, fanout, width, D, draw, first_exponent), P):
        key = tuple((token, parent) for token, parent, *_ in rows)
        shapes.add(tuple(parent for _, parent in key))
        realised[key] = (rows, realised.get(key, (rows, 0.0))[1] + weight)
    assert abs(sum(w for _, w in realised.values()) - 1.0) < TOL
    outcomes = {}
    for rows, weight in realised.values():
        n = len(rows)
        has_child = {parent for _, parent, *_ in rows}
        proposal = torch.full((1, n, P), float("-inf"))
        for i, (token, parent, depth, _) in enumerate(rows):
            if i in has_child:
                proposal[0, i] = session.logq(0, depth, token, rows[parent][0] if i else -1)
        tree = DraftTree(
            tokens=torch.tensor([[token for token, *_ in rows]]),
            parents=torch.tensor([[parent for _, parent, *_ in rows]], dtype=torch.int32),
            depths=torch.tensor([[depth for _, _, depth, _ in rows]], dtype=torch.int32),
            num_nodes=torch.tensor([n], dtype=torch.int32),
            draft_logq=torch.tensor([[logq for *_, logq in rows]], dtype=torch.float32),
            max_depth=D, pool_ids=ids, proposal_logq=proposal)
        probs = target_probs(tree, law)
        plan = traversal_plan(tree, probs)
        add_outcomes(outcomes, tree, enumerate_plan(tree, probs, plan), weight)
    return outcomes, shapes


@pytest.mark.parametrize("kind", ["smooth", "peaky", "zeros"])
@pytest.mark.parametrize("budget,width,fanout", [(3, 1, 8), (4, 2, 8), (5, 1, 2), (5, 3, 3)])
@pytest.mark.parametrize("first_exponent", [SAMPLED_FIRST_RANK_EXPONENT, 0.25, 1.0])
def test_sampled_weaver_trees_are_lossless_by_enumeration(kind, budget, width, fanout,
                                                          first_exponent, gen):
    """The sampled tree's law is the target's multi-step law to 1e-10 at the builder's
    first-slot exponent and others up to 1: slot scores that never read the slot's own
    token and never rank a node's later slot above an earlier one, so that its children are
    the first of its draws (above 1 they can: the next test)."""
    from test_tree_builders import FakeSession, make_pools

    V, D, P = 4, 3, 3
    # Zero-mass candidates with a target that has zeros too: slots past q's support.
    roots, ids, logits = make_pools(gen, 1, D, P, V, holes=kind == "zeros")
    session = FakeSession(ids, logits, V, gen, ties=False)
    root = int(roots[0])
    law = ContextLaw(V, int(torch.randint(0, 1 << 30, (1,), generator=gen)), kind)
    outcomes, _ = sampled_weaver_law(session, root, ids, budget, width, fanout, first_exponent,
                                     law)
    assert_lossless(law, root, outcomes, D + 1)


def first_draw_session(gen):
    """(session, root, ids): the root's q is (0.5, 0.45, 0.05) over its pool row; below its
    child the q row is flat (0.36, 0.33, 0.31) where the child holds pool position 0 and
    peaked (0.9, 0.05, 0.05) elsewhere."""
    from test_tree_builders import FakeSession, make_pools

    V, D, P = 4, 3, 3
    roots, ids, logits = make_pools(gen, 1, D, P, V)
    session = FakeSession(ids, logits, V, gen, ties=False)
    root = int(roots[0])
    session.table[0, 0, root, 0] = torch.tensor([0.5, 0.45, 0.05]).log()
    for position in range(P):
        row = [0.36, 0.33, 0.31] if position == 0 else [0.9, 0.05, 0.05]
        session.table[0, 1, int(ids[0, 0, position]), root + 1] = torch.tensor(row).log()
    return session, root, ids


@pytest.mark.parametrize("kind", ["smooth", "peaky", "zeros"])
def test_a_sampled_weaver_tree_whose_shape_follows_its_first_draw_is_lossless(kind, gen):
    """A slot's inclusion may depend on draws made before it: here the first draw decides
    the shape. The root's q is (0.5, 0.45, 0.05); below its first child the q row is flat
    (0.36, 0.33, 0.31) if the first draw is pool position 0 and peaked (0.9, 0.05, 0.05)
    otherwise. With budget 2, one node a pop, the second pop compares the root's second
    slot, log 0.45, with the first child's first slot, (log 0.5 + log max q) / 2 at the
    builder's exponent: the root's slot wins below the flat row, the child's below the
    peaked ones. Both shapes occur, and traversal keeps the target's law."""
    assert SAMPLED_FIRST_RANK_EXPONENT == 0.5  # the numbers above
    session, root, ids = first_draw_session(gen)
    law = ContextLaw(4, int(torch.randint(0, 1 << 30, (1,), generator=gen)), kind)
    outcomes, shapes = sampled_weaver_law(session, root, ids, 2, 1, 8,
                                          SAMPLED_FIRST_RANK_EXPONENT, law)
    assert shapes == {(-1, 0, 0), (-1, 0, 1)}
    assert_lossless(law, root, outcomes, ids.shape[1] + 1)


def test_slots_ranked_out_of_draw_order_move_the_law(gen):
    """The control: at first-slot exponent 2 the root's first slot scores 2 log 0.5 below
    its second, log 0.45, so a one-node tree holds the root's second draw without its first;
    traversal takes children as the first of the draws and the law moves."""
    session, root, ids = first_draw_session(gen)
    law = ContextLaw(4, int(torch.randint(0, 1 << 30, (1,), generator=gen)), "smooth")
    outcomes, shapes = sampled_weaver_law(session, root, ids, 1, 1, 8, 2.0, law)
    assert shapes == {(-1, 0)}
    with pytest.raises(AssertionError, match="max law error"):
        assert_lossless(law, root, outcomes, ids.shape[1] + 1)
