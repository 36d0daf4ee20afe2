"""Structured outputs inside draft trees.

Drafting core: the builders' child constraint (every drafted token is allowed below
its parent, the budget goes to allowed candidates, an all-allowed constraint changes
nothing). Glue, on a real xgrammar grammar over a tiny vocabulary: the scheduler's
tree bitmask row of node j is the grammar's mask after node j's path (decoding that
path as a chain) and leaves the grammar as it was; the runner-side constraint gives
the same rows. Verification, by enumeration: tree verifiers over the masked node
logits give exactly the law of decoding under the grammar (1e-10). Engine
(tests/test_structured_outputs.py's engine part, below): through ``LLM(...)``.
"""

from __future__ import annotations

import gc
import json
import os
import re
from collections import Counter

import pytest
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from test_engine_tp import NEEDS_TWO_CORES  # noqa: E402
from test_tree_builders import FakeSession, brute_weaver, check_invariants, make_pools  # noqa: E402
from test_verifiers import (  # noqa: E402
    ContextLaw,
    add_outcomes,
    assert_lossless,
    enumerate_plan,
    enumerate_target_only,
    run_target_only_cases,
    check_replay,
    run_plan_cases,
    sibling_orders,
)

from vllm_tfm.drafting.builders import (  # noqa: E402
    allowed_in_pool,
    build_chain,
    build_ddtree,
    build_sampled_tree,
    build_weaver_tree,
)
from vllm_tfm.drafting.tree import DraftTree  # noqa: E402
from vllm_tfm.drafting.verifiers import traversal_plan, verify_greedy  # noqa: E402

NEG_INF = float("-inf")


# -- a path-dependent rule as a child constraint --------------------------------------

def rule(depth: int, token: int, child: int) -> bool:
    """Children of a depth-``depth`` node holding ``token``: (child + token + depth) % 3."""
    return (child + token + depth) % 3 != 0


def bits(allowed: list[bool]) -> torch.Tensor:
    words = torch.zeros((len(allowed) + 31) // 32, dtype=torch.int64)
    for t, ok in enumerate(allowed):
        if ok:
            words[t // 32] |= 1 << (t % 32)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


class RuleConstraint:
    """``rule`` as a ``builders.ChildConstraint``: it walks each node's path, so it checks
    the tree it is handed too. Rows in ``free`` are unconstrained."""

    def __init__(self, vocab: int, free=(), everything=False):
        self.vocab, self.free, self.everything = vocab, set(free), everything
        self.calls = 0

    def child_bitmask(self, tokens, parents, nodes):
        self.calls += 1
        R, w = nodes.shape
        out = torch.empty(R, w, (self.vocab + 31) // 32, dtype=torch.int32)
        for r in range(R):
            for i in range(w):
                node = int(nodes[r, i])
                if node < 0 or r in self.free or self.everything:
                    out[r, i] = -1
                    continue
                depth, walk = 0, node
                while walk > 0:
                    walk = int(parents[r, walk])
                    depth += 1
                token = int(tokens[r, node])
                out[r, i] = bits([rule(depth, token, c) for c in range(self.vocab)])
        return out


def node_depth(tree: DraftTree, r: int, j: int) -> int:
    return int(tree.depths[r, j])


def assert_children_allowed(tree: DraftTree, free=()):
    for r in range(tree.batch_size):
        if r in free:
            continue
        for j in range(1, int(tree.num_nodes[r])):
            p = int(tree.parents[r, j])
            assert rule(node_depth(tree, r, p), int(tree.tokens[r, p]), int(tree.tokens[r, j])), (
                f"row {r} node {j}: token {int(tree.tokens[r, j])} forbidden below node {p}")


def test_allowed_in_pool_reads_the_bitmask(gen):
    V = 70
    allowed = torch.rand(3, 2, V, generator=gen) < 0.5
    mask = torch.stack([torch.stack([bits(row.tolist()) for row in per]) for per in allowed])
    ids = torch.randint(0, V, (3, 2, 9), generator=gen)
    assert torch.equal(allowed_in_pool(mask, ids), allowed.gather(-1, ids))


@pytest.mark.parametrize("budget,fanout,width", [(6, 2, 2), (12, 3, 3), (9, 4, 1)])
def test_weaver_tree_drafts_only_allowed_children(budget, fanout, width, gen):
    R, D, P, V = 3, 4, 6, 12
    roots, ids, logits = make_pools(gen, R, D, P, V)
    session = FakeSession(ids, logits, V, gen, ties=False)
    constraint = RuleConstraint(V, free={2})
    tree = build_weaver_tree(roots, ids, session, budget, fanout=fanout, expand_width=width,
                             constraint=constraint)
    check_invariants(tree, budget, D)
    assert_children_allowed(tree, free={2})
    # The same tree as best-first over log q with the forbidden children removed.
    masked = FakeSession(ids, logits, V, gen, ties=False)
    masked.table = session.table.clone()
    for r in range(2):
        for d in range(D):
            for token in range(V):
                forbid = torch.tensor([not rule(d, token, int(c)) for c in ids[r, d]])
                masked.table[r, d, token, :, forbid] = NEG_INF
    for r in range(R):
        want = brute_weaver(masked, r, int(roots[r]), ids[r], budget, fanout, width, D)
        got = [(int(tree.tokens[r, j]), int(tree.parents[r, j]))
               for j in range(1, int(tree.num_nodes[r]))]
        assert got == [(token, parent) for token, parent, *_ in want[1:]], r


def test_an_all_allowed_constraint_changes_no_tree(gen):
    R, D, P, V, budget = 3, 4, 6, 12, 10
    roots, ids, logits = make_pools(gen, R, D, P, V)
    seeds = torch.arange(R, dtype=torch.int64) + 3
    everything = RuleConstraint(V, everything=True)
    builds = [
        lambda c: build_weaver_tree(roots, ids, FakeSession(ids, logits, V,
                                    torch.Generator().manual_seed(1), False), budget,
                                    fanout=3, expand_width=2, constraint=c),
        lambda c: build_chain(roots, ids, logits, budget, constraint=c),
        lambda c: build_ddtree(roots, ids, logits, budget, constraint=c),
        lambda c: build_sampled_tree(roots, ids, logits, budget, seeds, constraint=c),
    ]
    for build in builds:
        plain, constrained = build(None), build(everything)
        for name in ("tokens", "parents", "num_nodes", "draft_logq"):
            assert torch.allclose(getattr(plain, name).float(), getattr(constrained, name).float(),
                                  atol=1e-6), name


@pytest.mark.parametrize("budget", [1, 5, 12, 40])
def test_ddtree_is_the_top_budget_allowed_prefixes(budget, gen):
    """Brute force: every prefix whose tokens the rule allows one by one, ranked by the
    sum of log-softmax marginals; the tree holds the best ``budget`` of them."""
    import itertools

    R, D, P, V = 3, 3, 5, 12
    roots, ids, logits = make_pools(gen, R, D, P, V)
    logp = torch.log_softmax(logits.double(), -1)
    tree = build_ddtree(roots, ids, logits, budget, constraint=RuleConstraint(V, free={1}))
    check_invariants(tree, budget, D)
    for r in range(R):
        prefixes = []
        for depth in range(1, D + 1):
            for picks in itertools.product(range(P), repeat=depth):
                tokens = [int(ids[r, d, k]) for d, k in enumerate(picks)]
                chain = [int(roots[r])] + tokens
                if r != 1 and not all(rule(d, chain[d], chain[d + 1]) for d in range(depth)):
                    continue
                score = sum(float(logp[r, d, k]) for d, k in enumerate(picks))
                prefixes.append((score, tuple(tokens)))
        want = {path for _, path in sorted(prefixes, reverse=True)[:budget]}
        got = {tuple(path_of(tree.tokens[r, 1:].tolist(), tree.parents[r, 1:].tolist(), j))
               for j in range(1, int(tree.num_nodes[r]))}
        assert got == want, r


def test_chain_takes_the_best_allowed_candidate_and_ends_where_none_is(gen):
    R, D, P, V = 4, 5, 3, 9
    roots, ids, logits = make_pools(gen, R, D, P, V)
    tree = build_chain(roots, ids, logits, D, constraint=RuleConstraint(V))
    for r in range(R):
        token, want = int(roots[r]), []
        for d in range(D):
            allowed = [p for p in range(P) if rule(d, token, int(ids[r, d, p]))]
            if not allowed:
                break
            best = max(allowed, key=lambda p: (float(logits[r, d, p]), -p))
            token = int(ids[r, d, best])
            want.append(token)
        assert int(tree.num_nodes[r]) == len(want) + 1
        assert tree.tokens[r, 1 : len(want) + 1].tolist() == want


@pytest.mark.parametrize("kind", ["ddtree", "weaver"])
def test_sampled_tree_draws_from_the_allowed_restriction(kind, gen):
    R, D, P, V, budget = 3, 3, 6, 12, 9
    roots, ids, logits = make_pools(gen, R, D, P, V)
    seeds = torch.arange(R, dtype=torch.int64) + 11
    if kind == "weaver":
        session = FakeSession(ids, logits, V, gen, ties=False)
        tree = build_weaver_tree(roots, ids, session, budget, seeds=seeds,
                                 constraint=RuleConstraint(V))
    else:  # DDTree keeps the marginals' shape: slots the rule empties get zero-mass tokens
        tree = build_sampled_tree(roots, ids, logits, budget, seeds, constraint=RuleConstraint(V))
    for r in range(R):
        for j in range(1, int(tree.num_nodes[r])):
            if tree.draft_logq[r, j] > NEG_INF:  # a real draw (not a zero-mass slot)
                p = int(tree.parents[r, j])
                assert rule(node_depth(tree, r, p), int(tree.tokens[r, p]), int(tree.tokens[r, j]))
        for j in range(int(tree.num_nodes[r])):
            row = tree.proposal_logq[r, j]
            if bool((row > NEG_INF).any()):  # an expanded node: q restricted and renormalized
                d, token = node_depth(tree, r, j), int(tree.tokens[r, j])
                forbidden = torch.tensor([not rule(d, token, int(c)) for c in ids[r, d]])
                assert bool((row[forbidden] == NEG_INF).all())
                assert abs(float(torch.logsumexp(row, 0))) < 1e-5


# -- a real grammar over a tiny vocabulary --------------------------------------------

TINY_VOCAB = ["a", "b", "c", "d", "<eos>"]
EOS = 4
TINY_REGEX = r"(ab|b|ca)+d?"


def tiny_grammar():
    """vLLM's xgrammar wrapper around ``TINY_REGEX`` over ``TINY_VOCAB``."""
    import xgrammar as xgr
    from vllm.v1.structured_output.backend_xgrammar import XgrammarGrammar

    info = xgr.TokenizerInfo(TINY_VOCAB, stop_token_ids=[EOS])
    ctx = xgr.GrammarCompiler(info).compile_regex(TINY_REGEX)
    matcher = xgr.GrammarMatcher(ctx, max_rollback_tokens=16)
    return XgrammarGrammar(vocab_size=len(TINY_VOCAB), matcher=matcher, ctx=ctx)


def allowed_after(grammar, tokens) -> list[bool] | None:
    """Decoding ``tokens`` as a chain: the tokens allowed next (None if the chain leaves
    the grammar; all tokens once it has terminated, as vLLM masks)."""
    from vllm_tfm.vllm_glue.grammar import fill_state_row

    if grammar.validate_tokens(list(tokens)) != list(tokens) and not grammar.is_terminated():
        return None
    if tokens:
        grammar.accept_tokens("", list(tokens))
    row = torch.zeros(1, 1, dtype=torch.int32)
    fill_state_row(grammar, row, 0)
    if tokens:
        grammar.rollback(len(tokens))
    return [bool((int(row[0, 0]) >> t) & 1) for t in range(len(TINY_VOCAB))]


def random_tree(gen, n: int, vocab: int) -> tuple[list[int], list[int]]:
    parents = [int(torch.randint(0, j, (1,), generator=gen)) for j in range(1, n)]
    tokens = [int(torch.randint(0, vocab, (1,), generator=gen)) for _ in range(1, n)]
    return tokens, parents


def path_of(tokens, parents, node):
    path = []
    while node > 0:
        path.append(tokens[node - 1])
        node = parents[node - 1]
    return path[::-1]


def test_tree_bitmask_rows_are_each_paths_chain_mask(gen):
    from vllm_tfm.vllm_glue.grammar import fill_state_row, fill_tree_bitmask

    grammar = tiny_grammar()
    grammar.accept_tokens("", [1])  # "b": the root is mid-output
    for _ in range(20):
        n = int(torch.randint(2, 12, (1,), generator=gen))
        # Mostly allowed tokens: grow each node from its parent's allowed set.
        tokens, parents = random_tree(gen, n, len(TINY_VOCAB))
        rows = torch.zeros(n + 2, 1, dtype=torch.int32)
        fill_state_row(grammar, rows, 1)
        fill_tree_bitmask(grammar, tokens, parents, rows, 1)
        for j in range(1, n):
            path = path_of(tokens, parents, j)
            want = allowed_after(grammar, path)
            reach = j
            while want is None:  # unreachable: the nearest reachable ancestor's row
                reach = parents[reach - 1]
                want = allowed_after(grammar, path_of(tokens, parents, reach))
            got = [bool((int(rows[1 + j, 0]) >> t) & 1) for t in range(len(TINY_VOCAB))]
            assert got == want, (tokens, parents, j)
        # The grammar is where it was: after "b".
        assert grammar.num_processed_tokens == 1
        assert allowed_after(grammar, []) == [True, True, True, True, True]


def test_runner_constraint_gives_the_path_masks_and_nothing_past_them():
    from vllm_tfm.vllm_glue.grammar import GrammarConstraint
    import xgrammar as xgr

    grammar = tiny_grammar()
    allocate = lambda rows: xgr.allocate_token_bitmask(rows, len(TINY_VOCAB))  # noqa: E731
    constraint = GrammarConstraint([grammar, None], allocate)
    # Row 0: root, then "c" (node 1), "a" below it (node 2), "c" again below that (3),
    # and "d" (node 4) below the root: unreachable below "c"'s sibling... d first is invalid.
    tokens = torch.tensor([[9, 2, 0, 2, 3], [9, 0, 0, 0, 0]])
    parents = torch.tensor([[-1, 0, 1, 2, 0], [-1, 0, 0, 0, 0]])
    nodes = torch.tensor([[0, 1, 2, 3, 4], [0, 1, -1, -1, -1]])
    masks = constraint.child_bitmask(tokens, parents, nodes)
    for i, node in enumerate(nodes[0].tolist()):
        path = path_of(tokens[0, 1:].tolist(), parents[0, 1:].tolist(), node)
        want = allowed_after(grammar, path)
        got = [bool((int(masks[0, i, 0]) >> t) & 1) for t in range(len(TINY_VOCAB))]
        assert got == (want if want is not None else [False] * len(TINY_VOCAB)), node
    assert bool((masks[1] == -1).all())
    assert grammar.num_processed_tokens == 0


# -- verification under the grammar, by enumeration ----------------------------------

class GrammarLaw:
    """Decoding under the grammar: the target's law at a context, restricted to the
    tokens the grammar allows after it and renormalized (float64)."""

    def __init__(self, law: ContextLaw, grammar, prefix: tuple):
        self.law, self.grammar, self.prefix = law, grammar, prefix
        self.vocab = law.vocab

    def __call__(self, context: tuple) -> torch.Tensor:
        allowed = allowed_after(self.grammar, list(context[len(self.prefix):]))
        if allowed is None:  # unreachable context: any law (it has probability 0)
            return self.law(context)
        p = self.law(context) * torch.tensor(allowed, dtype=torch.float64)
        return p / p.sum()


def masked_tree_probs(tree: DraftTree, law: ContextLaw, grammar, prefix: tuple) -> torch.Tensor:
    """[1, N, V] node probs as the engine forms them: target logits at each node, masked
    by the scheduler's tree bitmask rows (``fill_tree_bitmask``), softmaxed."""
    from vllm_tfm.vllm_glue.grammar import fill_state_row, fill_tree_bitmask

    n = int(tree.num_nodes[0])
    tokens = tree.tokens[0, 1:n].tolist()
    parents = tree.parents[0, 1:n].tolist()
    rows = torch.zeros(n, 1, dtype=torch.int32)
    fill_state_row(grammar, rows, 0)
    fill_tree_bitmask(grammar, tokens, parents, rows, 0)
    logits = torch.empty(1, n, law.vocab, dtype=torch.float64)
    for j in range(n):
        context = prefix + tuple(path_of(tokens, parents, j))
        allowed = torch.tensor([bool((int(rows[j, 0]) >> t) & 1) for t in range(law.vocab)])
        logits[0, j] = torch.log(law(context)).masked_fill(~allowed, NEG_INF)
    return torch.softmax(logits, -1)


def tiny_tree(tokens: list[int], parents: list[int], root: int, logq=None) -> DraftTree:
    n = len(tokens) + 1
    depths = [0]
    for p in parents:
        depths.append(depths[p] + 1)
    return DraftTree(
        tokens=torch.tensor([[root] + tokens]),
        parents=torch.tensor([[-1] + parents], dtype=torch.int32),
        depths=torch.tensor([depths], dtype=torch.int32),
        num_nodes=torch.tensor([n], dtype=torch.int32),
        draft_logq=torch.tensor([[0.0] + (logq or [-1.0] * (n - 1))]),
        max_depth=max(depths) + 1,
    )


# Trees over TINY_VOCAB after the output "b": allowed, forbidden and unreachable nodes.
GRAMMAR_TREES = {
    "allowed": ([0, 1, 2, 0], [0, 1, 0, 3]),  # a b | c a
    "forbidden_child": ([3, 0, 2, 1], [0, 0, 2, 0]),  # d (then only eos), a, c below a
    "deep_mixed": ([1, 2, 0, 1, 3, 4], [0, 1, 2, 2, 0, 5]),  # bbca, bbcb (forbidden), bd<eos>
}


@pytest.mark.parametrize("shape", list(GRAMMAR_TREES))
@pytest.mark.parametrize("kind", ["smooth", "peaky"])  # softmax logits: no exact zeros
def test_tree_verifiers_sample_the_constrained_law(shape, kind, gen):
    grammar = tiny_grammar()
    prefix = (1,)  # the output so far: "b" (the root)
    grammar.accept_tokens("", list(prefix))
    law = ContextLaw(len(TINY_VOCAB), int(torch.randint(0, 1 << 30, (1,), generator=gen)), kind)
    constrained = GrammarLaw(law, grammar, prefix)
    tokens, parents = GRAMMAR_TREES[shape]
    logq = torch.randn(len(tokens), generator=gen).tolist()
    tree = tiny_tree(tokens, parents, prefix[-1], logq)
    horizon = max(tree.depths[0].tolist()) + 1

    probs = masked_tree_probs(tree, law, grammar, prefix)
    # Target-only.
    cases = enumerate_target_only(tree, probs)
    check_replay(tree, probs, lambda t, p, c: run_target_only_cases(t, p, c), cases)
    outcomes = add_outcomes({}, tree, cases)
    assert_lossless(constrained, prefix[-1], outcomes, horizon)
    # Traversal (deterministic tree: sibling orders sampled from q).
    outcomes = {}
    for keys, order_weight in sibling_orders(tree):
        plan = traversal_plan(tree, probs, keys)
        cases = enumerate_plan(tree, probs, plan)
        check_replay(tree, probs, lambda t, p, c: run_plan_cases(t, p, plan, c), cases)
        add_outcomes(outcomes, tree, cases, order_weight)
    assert_lossless(constrained, prefix[-1], outcomes, horizon)
    # Greedy: the constrained argmax path.
    greedy = verify_greedy(tree, probs)
    node, want = 0, []
    while True:
        best = int(probs[0, node].argmax())
        child = next((c for c in range(1, len(tokens) + 1)
                      if parents[c - 1] == node and tokens[c - 1] == best), None)
        want.append(best)
        if child is None:
            break
        node = child
    assert greedy.output_tokens[0, : len(want)].tolist() == want
    assert grammar.num_processed_tokens == 1


# -- the engine: LLM(...) and the OpenAI server -------------------------------------

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                            "size": {"type": "integer"}},
          "required": ["name", "size"], "additionalProperties": False}
REGEX = r"def [a-z_]{1,12}\((self|x|n)?\):"
CHOICES = ["return self", "import os", "pass", "while True:"]
# An EBNF grammar (xgrammar's GBNF): a call with 1-3 single-letter arguments.
EBNF = 'root ::= name "(" args ")"\nname ::= [a-z]+\nargs ::= [a-z] ("," [a-z]){0,2}'


def constraints():
    from vllm.sampling_params import StructuredOutputsParams as S

    return {
        "json_schema": S(json=SCHEMA),
        "json_object": S(json_object=True),
        "regex": S(regex=REGEX),
        "choice": S(choice=CHOICES),
        "grammar": S(grammar=EBNF),
        "none": None,
    }


def valid(kind: str, text: str) -> bool:
    import jsonschema

    if kind == "json_schema":
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    if kind == "json_object":
        return isinstance(json.loads(text), dict)
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in CHOICES
    if kind == "grammar":
        return re.fullmatch(r"[a-z]+\([a-z](,[a-z]){0,2}\)", text) is not None
    return True


@pytest.fixture(scope="module")
def trained():
    from vllm_tfm.tiny.family import trained_family

    return trained_family()


def tfm_config(family, tree="weaver", **extra):
    from test_engine import tfm_config as engine_config

    return engine_config(family, tree, budget=16, **extra)


PROMPT = "def fibonacci(n):\n"
MAX_TOKENS = 48
# JSON without free whitespace, so that the tiny models close their objects (xgrammar's
# default lets them pad with whitespace until max_tokens).
ENGINE_OPTIONS = {"structured_outputs_config": {"backend": "xgrammar", "disable_any_whitespace": True}}


def greedy_run(family, speculative_config, **engine) -> dict:
    from vllm import SamplingParams

    from vllm_tfm.tiny.engine_runs import cpu_engine, top2_margins

    llm = cpu_engine(family.target, speculative_config, max_num_seqs=8, **ENGINE_OPTIONS,
                     **engine)
    kinds = constraints()
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=2,
                             structured_outputs=c) for c in kinds.values()]
    outputs = [o.outputs[0] for o in llm.generate([PROMPT] * len(params), params,
                                                    use_tqdm=False)]
    del llm  # before the next engine starts: its teardown resets global state
    gc.collect()
    return {"kinds": list(kinds), "tokens": [list(o.token_ids) for o in outputs],
            "texts": [o.text for o in outputs], "finish": [o.finish_reason for o in outputs],
            "margins": [top2_margins(o.logprobs) for o in outputs]}


@pytest.fixture(scope="module")
def no_speculation(trained):
    return greedy_run(trained, None)


@pytest.mark.engine
@pytest.mark.parametrize("tree", ["weaver", "chain", "ddtree"])
def test_greedy_equals_no_speculation_under_each_constraint(trained, no_speculation, tree,
                                                            monkeypatch):
    """A mixed batch (JSON schema, json_object, regex, choice, EBNF grammar, and one
    unconstrained request): every output equals decoding without speculation under the
    same constraint (up to bf16 ties), every finished output parses / matches, and no
    tree holds a node the grammar forbids (pruned while they grow)."""
    from vllm_tfm.tiny.engine_runs import compare_greedy
    from vllm_tfm.vllm_glue import grammar

    seen = Counter()
    copy_subtree, child_bitmask = grammar._copy_subtree, grammar.GrammarConstraint.child_bitmask

    def count_unreachable(*args):
        seen["unreachable"] += 1
        return copy_subtree(*args)

    def count_expansions(self, *args):
        seen["expansions"] += 1
        return child_bitmask(self, *args)

    monkeypatch.setattr(grammar, "_copy_subtree", count_unreachable)
    monkeypatch.setattr(grammar.GrammarConstraint, "child_bitmask", count_expansions)
    count_fallbacks(monkeypatch, seen)
    result = greedy_run(trained, tfm_config(trained, tree))
    for kind, text, finish in zip(result["kinds"], result["texts"], result["finish"]):
        assert kind == "none" or finish == "stop", (kind, text)
        assert valid(kind, text), (kind, text)
    for kind, row in zip(result["kinds"], compare_greedy(no_speculation, result)):
        if row["matched"] < row["length"]:
            assert row["tie"], (kind, row, result["texts"], no_speculation["texts"])
    assert seen["fallbacks"] == 0, "a tree step fell back to sampling its roots"
    assert seen["expansions"] > 0 and seen["unreachable"] == 0, dict(seen)


def count_fallbacks(monkeypatch, seen: Counter) -> None:
    """Count the steps whose tree verification failed (``verify.sample_roots``): exact
    output, but no draft accepted, so a test of trees must see none."""
    from vllm_tfm.vllm_glue import verify

    sample_roots = verify.sample_roots

    def counted(*args):
        seen["fallbacks"] += 1
        return sample_roots(*args)

    monkeypatch.setattr(verify, "sample_roots", counted)


@pytest.mark.engine
def test_a_batch_of_small_pruned_trees_is_verified(trained, no_speculation, monkeypatch):
    """A choice alone: the grammar prunes every tree of the step below the budget (trees
    of a few nodes, or the root only); they are verified as trees, and the output is the
    constrained greedy one."""
    from vllm import SamplingParams

    from vllm_tfm.tiny.engine_runs import cpu_engine, spec_counters

    seen = Counter()
    count_fallbacks(monkeypatch, seen)
    llm = cpu_engine(trained.target, tfm_config(trained), max_num_seqs=8,
                     disable_log_stats=False, **ENGINE_OPTIONS)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                            structured_outputs=constraints()["choice"])
    output = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    drafts, accepted = spec_counters(llm)
    del llm
    gc.collect()
    choice = no_speculation["kinds"].index("choice")
    assert list(output.token_ids) == no_speculation["tokens"][choice]
    assert seen["fallbacks"] == 0 and drafts > 0 and accepted > 0, (dict(seen), drafts, accepted)


def sampled_texts(llm, count: int) -> list[str]:
    """``count`` seeded T = 1 samples: every fourth under ``REGEX``, the others ``CHOICES``."""
    from vllm import SamplingParams

    kinds = constraints()
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=24,
                             structured_outputs=kinds["choice" if i % 4 else "regex"])
              for i in range(count)]
    return [o.outputs[0].text for o in llm.generate([PROMPT] * count, params, use_tqdm=False)]


def choice_counts(texts: list[str]) -> Counter:
    return Counter(text for i, text in enumerate(texts) if i % 4)


@pytest.mark.engine
def test_sampling_under_a_grammar_follows_the_constrained_distribution(trained):
    """T = 1 (sampled Weaver trees, traversal): the choices drawn match decoding without
    speculation (chi-square), every sample is valid, seeded requests reproduce."""
    from test_engine import _chi_square_p_value

    from vllm_tfm.tiny.engine_runs import cpu_engine

    count = 240
    llm = cpu_engine(trained.target, None, max_num_seqs=64, **ENGINE_OPTIONS)
    reference = sampled_texts(llm, count)
    del llm
    gc.collect()
    # One budget at every batch size: the default rule drafts 8-node trees from 16 running
    # requests on, and a seeded request reproduces under the same budgets only.
    llm = cpu_engine(trained.target, tfm_config(trained, budget_by_batch=[[1 << 20, 16]]),
                     max_num_seqs=64, **ENGINE_OPTIONS)
    speculative = sampled_texts(llm, count)
    again = sampled_texts(llm, count // 4)
    del llm
    gc.collect()
    for texts in (reference, speculative):
        for i, text in enumerate(texts):
            assert valid("choice" if i % 4 else "regex", text), (i, text)
    assert again == speculative[: count // 4], "seeded sampling must be reproducible"
    assert _chi_square_p_value(choice_counts(reference), choice_counts(speculative)) > 1e-3, (
        choice_counts(reference), choice_counts(speculative))


@pytest.mark.engine
def test_openai_server_serves_structured_outputs_with_dflash_tfm(trained, tmp_path):
    """response_format json_schema and json_object (chat), regex and choice (completions),
    greedy and sampled, streamed, through `vllm serve` (engine core in its own process)."""
    import sys

    from test_engine import _post

    from vllm_tfm.tiny.engine_runs import CPU_SERVER_ARGS, free_port, running_server

    port = free_port()
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(trained.target), *CPU_SERVER_ARGS, "--host", "127.0.0.1",
        "--port", str(port), "--speculative-config", json.dumps(tfm_config(trained)),
        "--structured-outputs-config", json.dumps(ENGINE_OPTIONS["structured_outputs_config"]),
    ]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    model = str(trained.target)
    with running_server(command, port, tmp_path / "server.log", start_timeout_s=240,
                        env=env) as base:
        for temperature in (0.0, 1.0):
            chat = _post(f"{base}/v1/chat/completions", {
                "model": model, "max_tokens": 64, "temperature": temperature, "seed": 3,
                "messages": [{"role": "user", "content": "Describe a file."}],
                "response_format": {"type": "json_schema", "json_schema": {
                    "name": "file", "schema": SCHEMA}},
            })
            choice = chat["choices"][0]
            assert choice["finish_reason"] == "stop", choice
            assert valid("json_schema", choice["message"]["content"])
            for kind, field in (("regex", {"regex": REGEX}), ("choice", {"choice": CHOICES})):
                completion = _post(f"{base}/v1/completions", {
                    "model": model, "prompt": PROMPT, "max_tokens": 32,
                    "temperature": temperature, "seed": 5, "structured_outputs": field,
                })
                text = completion["choices"][0]["text"]
                assert completion["choices"][0]["finish_reason"] == "stop", text
                assert valid(kind, text), (kind, text)
        chat = _post(f"{base}/v1/chat/completions", {
            "model": model, "max_tokens": 64, "temperature": 0,
            "messages": [{"role": "user", "content": "Describe a file."}],
            "response_format": {"type": "json_object"},
        })
        assert chat["choices"][0]["finish_reason"] == "stop", chat
        assert valid("json_object", chat["choices"][0]["message"]["content"])
        # Streamed: the pieces join into the same valid output as the whole answer.
        body = {"model": model, "prompt": PROMPT, "max_tokens": 32, "temperature": 0,
                "structured_outputs": {"regex": REGEX}}
        whole = _post(f"{base}/v1/completions", body)["choices"][0]["text"]
        assert _streamed_text(f"{base}/v1/completions", body) == whole
        assert valid("regex", whole), whole
    log = (tmp_path / "server.log").read_text(errors="replace")
    assert "dflash_tfm:" not in log, "a tree stage failed (see runner.py's fault list)"


def _streamed_text(url: str, body: dict) -> str:
    import urllib.request

    request = urllib.request.Request(url, data=json.dumps({**body, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"})
    pieces = []
    with urllib.request.urlopen(request, timeout=120) as response:
        for line in response:
            line = line.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                pieces.append(json.loads(line[6:])["choices"][0]["text"])
    return "".join(pieces)


@pytest.mark.engine
@NEEDS_TWO_CORES
def test_tensor_parallel_trees_reach_the_scheduler(monkeypatch):
    """TP = 2 (workers in their own processes): the first rank's trees travel to the
    scheduler on the pickled drafts, which masks every node by its path; its draft-time
    grammars prune them; greedy output equals no speculation at the same TP."""
    from vllm_tfm.tiny.engine_runs import compare_greedy
    from vllm_tfm.tiny.family import trained_family_with_experts
    from vllm_tfm.vllm_glue import grammar

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND",
                       os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0|1"))
    family = trained_family_with_experts()
    seen = Counter()
    fill_tree, copy_subtree = grammar.fill_tree_bitmask, grammar._copy_subtree

    def count_trees(*args):
        seen["trees"] += 1
        return fill_tree(*args)

    def count_unreachable(*args):
        seen["unreachable"] += 1
        return copy_subtree(*args)

    monkeypatch.setattr(grammar, "fill_tree_bitmask", count_trees)
    monkeypatch.setattr(grammar, "_copy_subtree", count_unreachable)
    runs = [greedy_run(family, config, tensor_parallel_size=2)
            for config in (None, tfm_config(family))]
    plain, speculative = runs
    for kind, text, finish in zip(speculative["kinds"], speculative["texts"],
                                  speculative["finish"]):
        assert kind == "none" or finish == "stop", (kind, text)
        assert valid(kind, text), (kind, text)
    for kind, row in zip(speculative["kinds"], compare_greedy(plain, speculative)):
        if row["matched"] < row["length"]:
            assert row["tie"], (kind, row, speculative["texts"], plain["texts"])
    assert seen["trees"] > 0 and seen["unreachable"] == 0, dict(seen)
