"""Draft-tree builders: chain, DDTree, Weaver best-first, sampled.

All take the DFlash candidate pools of R requests: ``pool_ids`` [R, D, P]
int64 (row d = the P candidates for draft position d + 1, i.e. for the
children of depth-d nodes; distinct ids per row) and, where needed,
``pool_logits`` [R, D, P] float raw logits of those candidates; plus
``root_tokens`` [R] int64, the previous step's bonus tokens. Each returns a
:class:`DraftTree` of N = budget + 1 columns (root + at most ``budget``
drafted nodes), batched over requests: loops run over depths or expansion
steps, never over nodes or requests.

Tie-breaking (exactly what the brute-force tests reproduce):

* chain: the first maximal candidate of a row (``torch.argmax``).
* DDTree / sampled shape: prefixes are ranked by (score descending, depth
  ascending, position within the depth ascending), where the position
  within depth d + 1 orders by (score descending, parent's position,
  candidate rank); candidate ranks order a row by (log q descending, pool
  index ascending).
* Weaver: a node's children are its top ``fanout`` candidates by (log q
  descending, pool index ascending); the frontier pops by (score descending,
  insertion order ascending), children inserted in pop order then rank. A
  sampled Weaver tree ranks its slots the same way, by the i-th largest log q
  (the first scaled by ``SAMPLED_FIRST_RANK_EXPONENT``) rather than by the token drawn
  into slot i, and a node's score is its slot's.

Every builder takes an optional :class:`ChildConstraint` (a grammar, for
structured outputs): a candidate it forbids below a node is never drafted
there, and the budget goes to the allowed ones. It is asked once per expansion
step (chain, DDTree, sampled: per depth) about the nodes being expanded: the
Weaver's pops, the chain's last node, DDTree's entries of a level that can
still be among the best ``budget`` prefixes, the sampled tree's internal nodes;
at most ``budget`` per request and step. Sampled trees draw from q restricted to
what the constraint allows.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

from triton_ops.counter_random import counter_gumbel
from triton_ops.weaver_step import ExpandBatch, Frontier, GrowingTree, pop_frontier, push_children
from vllm_tfm.drafting.tree import DraftTree
from vllm_tfm.options import DEFAULT_FANOUT, default_expand_width

# counter_uniform stream of the sampled builder's Gumbel noise.
BUILD_STREAM = 1
# A sampled Weaver tree scores a node's first child slot by max q ** this, its later slots by
# their rank's q. Under traversal the first child is accepted far more often than max q
# where q is flat (about 1 - TV(p, q), not max q), later ones about as often as their
# rank's q. Committed family, T = 1, budget 64 (BENCHMARKS.md, "Sampled Weaver trees scored
# by rank"): traversal's exact expected accepted length on the same contexts, +7-12 % for
# rank q alone and +15-17 % at 0.5 (0.25, 0.35, 0.65 between) over slots ranked on the drawn
# tokens' path q; eval_acceptance's tau 2.472 (path q), 2.560 (1), 2.668 (0.25), 2.751 (0.5).
# At most 1: see push_children.
SAMPLED_FIRST_RANK_EXPONENT = 0.5
# A sampled DDTree tree keeps the marginals' own shape: 0.5 there too lost 1.8 % of
# traversal's expected accepted length (committed family, T = 1, budget 64; BENCHMARKS.md,
# "A first-rank exponent for sampled DDTree trees").
DDTREE_SAMPLED_FIRST_RANK_EXPONENT = 1.0


def sampled_first_exponent(tree: str, first_exponent: float | None = None) -> float:
    """The first child slot's score exponent a sampled tree of kind ``tree`` is built with:
    ``first_exponent``, or the kind's own where None."""
    if first_exponent is not None:
        return first_exponent
    return SAMPLED_FIRST_RANK_EXPONENT if tree == "weaver" else DDTREE_SAMPLED_FIRST_RANK_EXPONENT


class ChildConstraint(Protocol):
    """Which tokens the children of expanded nodes may take (a grammar's state on each
    node's path; ``vllm_tfm.vllm_glue.grammar.GrammarConstraint``)."""

    def child_bitmask(
        self, tokens: torch.Tensor, parents: torch.Tensor, nodes: torch.Tensor
    ) -> torch.Tensor:
        """[R, w, ceil(V / 32)] int32 bitmask of each node's allowed children (bit
        t % 32 of word t // 32 set = token t allowed).

        ``tokens``, ``parents``: [R, M] int64, the tree so far (column 0 the root,
        parents before children); ``nodes``: [R, w] int64 columns to expand, -1 for
        padding (any row)."""
        ...


def allowed_in_pool(bitmask: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """[R, w, P] bool: candidate ``ids`` [R, w, P] is allowed by ``bitmask`` [R, w, W]."""
    words = bitmask.gather(-1, (ids >> 5).clamp(max=bitmask.shape[-1] - 1))
    return ((words >> (ids & 31).to(words.dtype)) & 1).bool() & (ids < 32 * bitmask.shape[-1])


def _constrained_rows(constraint: ChildConstraint, tokens, parents, nodes, ids,
                      rows: torch.Tensor) -> torch.Tensor:
    """``rows`` [R, w, P] log q with -inf where the constraint forbids the candidate."""
    allowed = allowed_in_pool(constraint.child_bitmask(tokens, parents, nodes), ids)
    return rows.masked_fill(~allowed, float("-inf"))


class ExpandSession(Protocol):
    """One Weaver draft round (``vllm_tfm.drafting.weaver.WeaverRound``)."""

    def expand(
        self,
        node_index: torch.Tensor,
        tokens: torch.Tensor,
        parent_index: torch.Tensor,
        depths: torch.Tensor,
    ) -> torch.Tensor:
        """Add w nodes per request and score their children's pool row.

        Args are [R, w] int64: the node's tree index (-1 = padding row), its
        token, its parent's index (-1 for the root) and its depth. Returns
        [R, w, P] float32 log q over pool row ``depth``; -inf for padding rows
        and depth-D rows.
        """
        ...


def build_chain(
    root_tokens: torch.Tensor,
    pool_ids: torch.Tensor,
    pool_logits: torch.Tensor,
    budget: int,
    validate: bool = True,
    constraint: ChildConstraint | None = None,
) -> DraftTree:
    """The DFlash chain: the argmax of each marginal, min(budget, D) nodes.

    With ``constraint``, the argmax among the candidates it allows below the chain
    so far; a request's chain ends where it allows none."""
    _check_inputs(root_tokens, pool_ids, pool_logits, budget, validate)
    R, D, _ = pool_ids.shape
    n = min(budget, D)
    logp = torch.log_softmax(pool_logits[:, :n].float(), dim=-1)
    node = torch.arange(n + 1, device=pool_ids.device).expand(R, -1)
    num_nodes = torch.full((R,), n + 1, dtype=torch.int32, device=pool_ids.device)
    if constraint is not None:
        logp, num_nodes = _constrained_chain(constraint, root_tokens, pool_ids[:, :n], logp)
    best = logp.argmax(-1, keepdim=True)
    return DraftTree(
        tokens=torch.cat([root_tokens[:, None], pool_ids[:, :n].gather(-1, best)[..., 0]], 1),
        parents=(node - 1).to(torch.int32),
        depths=node.to(torch.int32),
        num_nodes=num_nodes,
        draft_logq=torch.cat([logp.new_zeros(R, 1), logp.gather(-1, best)[..., 0]], 1),
        max_depth=D,
    )


def _constrained_chain(constraint: ChildConstraint, root_tokens, pool_ids, logp):
    """The chain's log-probs with -inf where ``constraint`` forbids a candidate below
    the chain's argmax prefix, and [R] int32 node counts (the chain ends at the first
    depth with no allowed candidate)."""
    R, n, _ = pool_ids.shape
    tokens = torch.cat([root_tokens[:, None], pool_ids.new_zeros(R, n)], 1)
    parents = (torch.arange(n + 1, device=pool_ids.device) - 1).expand(R, -1)
    alive = torch.ones(R, dtype=torch.bool, device=pool_ids.device)
    rows = []
    for d in range(n):
        nodes = torch.where(alive, d, -1)[:, None]
        row = _constrained_rows(constraint, tokens, parents, nodes, pool_ids[:, d, None],
                                logp[:, d, None])[:, 0]
        alive = alive & (row > float("-inf")).any(-1)
        rows.append(row)
        tokens[:, d + 1] = pool_ids[:, d].gather(-1, row.argmax(-1, keepdim=True))[:, 0]
    depth_alive = torch.stack([(row > float("-inf")).any(-1) for row in rows], 1)
    num_nodes = 1 + depth_alive.int().cumprod(1).sum(1)
    return torch.stack(rows, 1), num_nodes.to(torch.int32)


def build_ddtree(
    root_tokens: torch.Tensor,
    pool_ids: torch.Tensor,
    pool_logits: torch.Tensor,
    budget: int,
    validate: bool = True,
    constraint: ChildConstraint | None = None,
) -> DraftTree:
    """DDTree: the ``budget`` most likely prefixes under the product of marginals.

    The score of a prefix is the sum of log-softmax(pool logits) of its tokens
    at their depths. The result is the set a best-first heap over (depth,
    rank) pops (pop, push next sibling and first child), computed level by
    level instead: the depth-(d+1) members of the top-``budget`` set are
    children of depth-d members with a rank below ``budget``, so each depth
    keeps only its best ``budget`` candidates. Nodes come in best-first order.

    ``constraint``: the ``budget`` most likely prefixes among those it allows token by
    token. Each level asks it about that level's entries that can still be among the
    best ``budget`` (at most ``budget`` per level, on the host).
    """
    _check_inputs(root_tokens, pool_ids, pool_logits, budget, validate)
    logp = torch.log_softmax(pool_logits.float(), dim=-1)
    levels = None if constraint is None else _ConstrainedLevels(constraint, root_tokens,
                                                                pool_ids, budget)
    shape = _best_prefixes(logp, budget, levels)
    R, D, _ = pool_ids.shape
    row = (shape.depth - 1).clamp(min=0)
    drafted = pool_ids[torch.arange(R, device=pool_ids.device)[:, None], row].gather(
        -1, shape.pool_index[..., None]
    )[..., 0]
    return _assemble(
        root_tokens, shape, torch.where(shape.chosen, drafted, 0), shape.logq, max_depth=D
    )


def build_weaver_tree(
    root_tokens: torch.Tensor,
    pool_ids: torch.Tensor,
    session: ExpandSession,
    budget: int,
    fanout: int = DEFAULT_FANOUT,
    expand_width: int | None = None,
    max_depth: int | None = None,
    validate: bool = True,
    backend: str = "auto",
    constraint: ChildConstraint | None = None,
    seeds: torch.Tensor | None = None,
    first_exponent: float = SAMPLED_FIRST_RANK_EXPONENT,
) -> DraftTree:
    """Weaver's best-first tree (DESIGN.md section 3).

    The root is expanded and its top ``fanout`` children enter the frontier
    with score = parent score + log q. Each step pops the top w frontier
    entries (w = ``expand_width`` or ``options.default_expand_width``), adds them
    as nodes, expands them in ONE ``session.expand`` call and pushes
    ``fanout`` children of each; nodes at ``max_depth`` (default D) are
    never expanded. The pop schedule is fixed by ``budget`` and w, so no step
    reads the device; a request whose frontier runs dry gets padding rows
    and ends with fewer nodes. The last pop is not expanded. Every tensor keeps
    its shape from step to step, so a CUDA graph can capture the loop.

    Pops and pushes run through ``triton_ops.weaver_step.pop_frontier`` and
    ``push_children`` (``backend``: one Triton launch each, or the stable
    sorts of the reference; both give the same trees).

    ``constraint``: children it forbids get log q -inf, so they never enter the
    frontier (it reads the host once per expansion step: no CUDA graph).

    ``seeds`` ([R] int64, see :func:`vllm_tfm.drafting.tree.derive_seeds`): a SAMPLED
    tree, the input traversal verification gains on. Node u's i-th child slot is scored
    u's own slot score + the i-th largest log q(. | u) (the first times ``first_exponent``,
    in (0, 1]: ``SAMPLED_FIRST_RANK_EXPONENT`` by default) and holds the i-th token of a
    Gumbel-top-k draw from q(. | u) over u's pool row (restricted to what ``constraint``
    allows, renormalized).
    No score reads a drawn token's q, so whether a slot enters the tree never depends on
    the token drawn into it, only on draws made before (at its ancestors and at nodes
    popped before it), which keeps traversal lossless (exact enumeration:
    tests/test_verifiers.py); u's children are the first of its draws, in node order. The
    tree carries ``pool_ids`` and ``proposal_logq``.
    """
    _check_inputs(root_tokens, pool_ids, None, budget, validate)
    if seeds is not None:
        _check_seeds(seeds, pool_ids)
    R, D, P = pool_ids.shape
    max_depth = D if max_depth is None else max_depth
    _check_int("max_depth", max_depth, 0, D)
    _check_int("fanout", fanout, 1, None)
    if expand_width is not None:
        _check_int("expand_width", expand_width, 1, None)
    width = expand_width or default_expand_width(budget)
    device = pool_ids.device
    N = budget + 1

    def zeros(cols: int, dtype=torch.int64, fill=0) -> torch.Tensor:
        return torch.full((R, cols), fill, dtype=dtype, device=device)

    # Column N is a scratch slot that padding rows write to.
    tree = GrowingTree(zeros(N + 1), zeros(N + 1, fill=-1), zeros(N + 1),
                       zeros(N + 1, torch.float32),
                       torch.ones(R, dtype=torch.int64, device=device))
    tree.tokens[:, 0] = root_tokens

    pops = weaver_pops(budget, width)
    if max_depth == 0:
        pops = []
    children = min(fanout, P)
    # Room for every push, and never fewer columns than one pop takes.
    capacity = max(children * (1 + sum(pops[:-1])), max(pops, default=0))
    frontier = Frontier(zeros(capacity, torch.float32, float("-inf")), zeros(capacity),
                        zeros(capacity), zeros(capacity), zeros(capacity, torch.float32))
    fill = 0
    requests = torch.arange(R, device=device)[:, None]
    if seeds is not None:
        proposal = torch.full((R, N + 1, P), float("-inf"), device=device)

    def expand_and_push(batch: ExpandBatch) -> None:
        nonlocal fill
        rows = session.expand(batch.node, batch.token, batch.parent, batch.depth)
        w = batch.node.shape[1]
        if tuple(rows.shape) != (R, w, P):
            raise ValueError(
                f"session.expand returned shape {list(rows.shape)}, expected {[R, w, P]}"
            )
        rows = rows.float()
        if constraint is not None:
            ids = pool_ids[requests, batch.depth.clamp(max=D - 1)]
            rows = _constrained_rows(constraint, tree.tokens, tree.parents, batch.node, ids,
                                     rows)
        drawn = None
        if seeds is not None:
            if constraint is not None:
                rows = _renormalized(rows)
            proposal[requests, torch.where(batch.node >= 0, batch.node, N)] = rows
            drawn = _draw_order(rows, batch.node, seeds)[..., :children]
        push_children(frontier, fill, rows, batch, pool_ids, children, drawn=drawn,
                      first_exponent=1.0 if seeds is None else first_exponent,
                      backend=backend)
        fill += w * children

    if pops:
        zero = zeros(1)
        expand_and_push(ExpandBatch(zero, root_tokens[:, None], zero - 1, zero,
                                    zeros(1, torch.float32)))
    for step, k in enumerate(pops):
        batch = pop_frontier(frontier, tree, k, max_depth, backend=backend)
        if step + 1 < len(pops):
            expand_and_push(batch)

    tokens, parents, depths, logq, num = tree
    draws = {}
    if seeds is not None:  # rows of nodes left without children are not proposals
        proposal = proposal[:, :N].masked_fill(~_has_children(parents[:, :N])[..., None],
                                               float("-inf"))
        draws = dict(pool_ids=pool_ids, proposal_logq=proposal)
    return DraftTree(
        tokens=tokens[:, :N],
        parents=parents[:, :N].to(torch.int32),
        depths=depths[:, :N].to(torch.int32),
        num_nodes=num.to(torch.int32),
        draft_logq=logq[:, :N],
        max_depth=max_depth,
        **draws,
    )


def weaver_pops(budget: int, width: int) -> list[int]:
    """Nodes each pop of :func:`build_weaver_tree` takes: ``width``, the last what is left."""
    return [min(width, budget - start) for start in range(0, budget, width)]


def build_sampled_tree(
    root_tokens: torch.Tensor,
    pool_ids: torch.Tensor,
    pool_logits: torch.Tensor,
    budget: int,
    seeds: torch.Tensor,
    validate: bool = True,
    constraint: ChildConstraint | None = None,
    fixed_widths: bool = False,
    first_exponent: float = DDTREE_SAMPLED_FIRST_RANK_EXPONENT,
) -> DraftTree:
    """DDTree's tree with SAMPLED children: the exact input of traversal.

    Traversal verification is lossless only when every node's children are
    drawn from the proposal it is given. Here:

    * the shape (which node has how many children) is the DDTree shape of the
      marginals, each depth's largest log-probability times ``first_exponent``
      (in (0, 1]; the first child slot, as in a sampled Weaver tree): a function
      of the drafter's outputs, never of the drawn tokens;
    * the k children of an expanded node u at depth d are the first k of a
      Gumbel-top-k order of the marginal q_d over u's pool row: an ordered
      sample without replacement, in node order;
    * ``proposal_logq`` keeps q at every expanded node.

    (Weaver's sampled tree grows best-first instead: ``build_weaver_tree`` with seeds.)

    A slot beyond the support of q gets a zero-mass token (draft_logq -inf)
    that traversal treats as absent. ``seeds``: [R] int64 per-request seeds
    (see :func:`vllm_tfm.drafting.tree.derive_seeds`).

    ``constraint``: q at each expanded node is restricted to the candidates it
    allows there and renormalized, so the children are drawn from (and
    ``proposal_logq`` holds) that restricted q; the shape stays the marginals'.

    ``fixed_widths``: each depth's draws run over the most nodes that depth can hold
    (``sampled_call_widths``) instead of the widths read back from the device: the same
    tree (the extra rows are padding), no host read, so a CUDA graph can hold the build.
    """
    _check_inputs(root_tokens, pool_ids, pool_logits, budget, validate)
    _check_seeds(seeds, pool_ids)
    R, D, P = pool_ids.shape
    device = pool_ids.device
    N = budget + 1
    batch = torch.arange(R, device=device)[:, None]
    marginal = torch.log_softmax(pool_logits.float(), dim=-1)
    shape = _best_prefixes(_first_rank_scaled(marginal, first_exponent), budget)
    tree = _assemble(root_tokens, shape, torch.zeros_like(shape.depth), shape.logq, max_depth=D)
    depth, parent, valid = tree.depths.long(), tree.parents.long(), tree.valid
    rank = torch.cat([torch.zeros_like(shape.rank[:, :1]), shape.rank], 1)
    internal = _has_children(parent) & valid
    levels = torch.arange(D, device=device)[:, None]
    per_depth = internal[:, None, :] & (depth[:, None, :] == levels)  # [R, D, N]
    if fixed_widths:
        widths = sampled_call_widths(budget, D, P)
    else:  # one host read: call widths per depth
        widths = per_depth.sum(-1).amax(0).tolist()

    tokens, logq = tree.tokens.clone(), tree.draft_logq.clone()
    proposal = torch.full((R, N + 1, P), float("-inf"), device=device)
    node_ids = torch.arange(N, device=device)
    for d, w in enumerate(widths):
        if w == 0:
            break  # no expanded node at depth d means no node deeper than d
        here = per_depth[:, d]
        order = torch.argsort(torch.where(here, node_ids, N + node_ids), dim=1)[:, :w]
        real = here.gather(1, order)
        node = torch.where(real, order, -1)
        rows = marginal[:, d, None, :].masked_fill(~real[..., None], float("-inf"))
        if constraint is not None:
            rows = _renormalized(_constrained_rows(
                constraint, tokens, parent, node, pool_ids[:, d, None].expand(R, w, P), rows))
        proposal[batch, torch.where(real, order, N)] = rows
        drawn = _draw_order(rows, order, seeds)  # [R, w, P]
        slot_of = torch.zeros(R, N + 1, dtype=torch.int64, device=device)
        slots = torch.arange(w, device=device).expand(R, w)
        slot_of.scatter_(1, torch.where(real, order, N), slots)
        child = valid & (depth == d + 1)
        parent_slot = slot_of.gather(1, parent.clamp(min=0))
        pos = drawn[batch, parent_slot, rank.clamp(max=P - 1)]
        tokens = torch.where(child, pool_ids[:, d].gather(1, pos), tokens)
        logq = torch.where(child, rows[batch, parent_slot, pos], logq)

    return DraftTree(
        tokens=tokens,
        parents=tree.parents,
        depths=tree.depths,
        num_nodes=tree.num_nodes,
        draft_logq=logq,
        max_depth=D,
        pool_ids=pool_ids,
        proposal_logq=proposal[:, :N].contiguous(),
    )


def _first_rank_scaled(logp: torch.Tensor, first_exponent: float) -> torch.Tensor:
    """[R, D, P] ``logp`` with each row's largest entry times ``first_exponent`` (in
    (0, 1]: it stays the largest)."""
    if not 0 < first_exponent <= 1:
        raise ValueError(f"first_exponent must be in (0, 1], got {first_exponent}")
    top = logp.argmax(-1, keepdim=True)
    return logp.scatter(-1, top, logp.gather(-1, top) * first_exponent)


def _has_children(parents: torch.Tensor) -> torch.Tensor:
    """[R, N] bool: node i is some node's parent (``parents`` [R, N], -1 for none)."""
    N = parents.shape[1]
    has = torch.zeros(parents.shape[0], N + 1, dtype=torch.bool, device=parents.device)
    has.scatter_(1, torch.where(parents >= 0, parents, N).long(), True)
    return has[:, :N]


def _draw_order(rows: torch.Tensor, node: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """[R, w, P] each row's pool positions in Gumbel-top-k order: an ordered sample without
    replacement from softmax(``rows``) [R, w, P], keyed by (request seed, node index, pool
    position) so that a node's draws depend on nothing else; zero-mass positions last."""
    P = rows.shape[-1]
    counters = node.clamp(min=0)[..., None] * P + torch.arange(P, device=rows.device)
    keys = rows.double() + counter_gumbel(seeds, BUILD_STREAM, counters)
    return torch.argsort(keys, dim=-1, descending=True, stable=True)


def _check_seeds(seeds: torch.Tensor, pool_ids: torch.Tensor) -> None:
    R = pool_ids.shape[0]
    if seeds.shape != (R,) or seeds.dtype != torch.int64 or seeds.device != pool_ids.device:
        raise ValueError(f"seeds must be int64 [R={R}] on {pool_ids.device}, got "
                         f"{seeds.dtype} {list(seeds.shape)} on {seeds.device}")


def sampled_call_widths(budget: int, depth: int, pool: int) -> list[int]:
    """Per depth d < ``depth``, the most expanded nodes a tree of ``budget`` nodes after
    the root can hold there: min(pool^d, budget - d). An expanded node at depth d has a
    child at d + 1, and depths 1..d + 1 take at least one of the budget's nodes each."""
    return [min(pool ** d, max(budget - d, 0)) for d in range(depth)]


def _renormalized(rows: torch.Tensor) -> torch.Tensor:
    """Log-probs over each row's finite entries (rows with none stay -inf)."""
    total = torch.logsumexp(rows, dim=-1, keepdim=True)
    return torch.where(total > float("-inf"), rows - total, rows)


class _ConstrainedLevels:
    """The prefixes of a constrained DDTree so far, as the forest the constraint reads:
    column 0 the root, then each level's entries in order (``_best_prefixes``)."""

    def __init__(self, constraint: ChildConstraint, root_tokens: torch.Tensor,
                 pool_ids: torch.Tensor, budget: int):
        self.constraint, self.pool_ids, self.budget = constraint, pool_ids, budget
        self.tokens = root_tokens[:, None]
        self.parents = torch.full_like(self.tokens, -1)
        self.last = torch.zeros_like(self.tokens)  # columns of the last level's entries

    def level(self, d: int, prev: torch.Tensor, scores: list, sorted_logp, order, ranks: int):
        """[R, w, ranks] log-probs of the best ``ranks`` allowed candidates below each of
        the w previous-level entries (-inf past them), and their ranks in the sorted row."""
        R, w = prev.shape
        alive = prev > float("-inf")
        if scores:  # below the budget-th best prefix so far: no member, nor below it
            seen = torch.cat(scores, 1)
            kth = seen.topk(min(self.budget, seen.shape[1]), dim=1).values[:, -1:]
            alive &= prev >= kth
        ids = self.pool_ids[:, d].gather(1, order[:, d])  # the sorted row's tokens
        masked = _constrained_rows(self.constraint, self.tokens, self.parents,
                                   torch.where(alive, self.last, -1),
                                   ids[:, None].expand(R, w, -1),
                                   sorted_logp[:, d, None].expand(R, w, -1))
        masked = masked.masked_fill(~alive[..., None], float("-inf"))
        # The row is sorted: a stable sort moves the allowed candidates first, in order.
        values, rank = torch.sort(masked, dim=-1, descending=True, stable=True)
        return values[..., :ranks], rank[..., :ranks]

    def add_level(self, d: int, parents: torch.Tensor, ranks: torch.Tensor, order) -> None:
        """Append level d's entries: ``parents`` their parents' flat indices among the
        earlier entries (-1 = the root), ``ranks`` their tokens' ranks in the sorted row."""
        width = self.tokens.shape[1]
        ids = self.pool_ids[:, d].gather(1, order[:, d].gather(1, ranks))
        self.tokens = torch.cat([self.tokens, ids], 1)
        self.parents = torch.cat([self.parents, torch.where(parents >= 0, parents + 1, 0)], 1)
        self.last = width + torch.arange(ranks.shape[1], device=ranks.device).expand_as(ranks)


class _Prefixes(NamedTuple):
    """The top-``budget`` prefixes in best-first order, [R, budget] each."""

    chosen: torch.Tensor  # bool, real entry (fewer than budget prefixes may exist)
    depth: torch.Tensor  # int64 >= 1
    parent: torch.Tensor  # int64 node index (0 = root, i + 1 = entry i)
    rank: torch.Tensor  # int64 rank of the token in its sorted pool row
    pool_index: torch.Tensor  # int64 position of the token in the unsorted pool row
    logq: torch.Tensor  # float32 log-prob of the token at its depth


def _best_prefixes(logp: torch.Tensor, budget: int,
                   constrained: _ConstrainedLevels | None = None) -> _Prefixes:
    """Top-``budget`` prefixes of [R, D, P] per-depth log-probs, level by level.

    ``constrained``: only prefixes whose every token its constraint allows below the
    prefix before it (each level's entries are expanded with the constraint's mask;
    those that cannot be among the top ``budget`` any more are not asked about)."""
    R, D, P = logp.shape
    device = logp.device
    sorted_logp, order = torch.sort(logp, dim=-1, descending=True, stable=True)
    ranks = min(budget, P)
    scores, parents, token_ranks, levels = [], [], [], []
    prev = torch.zeros(R, 1, device=device)
    offset = 0
    for d in range(D):
        if constrained is None:
            row_logp = sorted_logp[:, d, None, :ranks]
            row_rank = torch.arange(ranks, device=device).expand(R, prev.shape[1], -1)
        else:
            row_logp, row_rank = constrained.level(d, prev, scores, sorted_logp, order, ranks)
        cand = (prev[:, :, None] + row_logp).reshape(R, -1)
        score, idx = torch.sort(cand, dim=-1, descending=True, stable=True)
        keep = min(budget, cand.shape[1])
        score, idx = score[:, :keep], idx[:, :keep]
        parent_pos = idx // ranks
        # Flat index of the parent among all levels; -1 = the root.
        parents.append(parent_pos + offset - prev.shape[1] if d > 0 else torch.full_like(idx, -1))
        scores.append(score)
        token_ranks.append(row_rank.reshape(R, -1).gather(1, idx))
        levels.append(torch.full((keep,), d, dtype=torch.int64, device=device))
        if constrained is not None:
            constrained.add_level(d, parents[-1], token_ranks[-1], order)
        offset += keep
        prev = score
    score, pick = torch.sort(torch.cat(scores, 1), dim=-1, descending=True, stable=True)
    width = min(budget, score.shape[1])
    score, pick = score[:, :width], pick[:, :width]
    chosen = score > float("-inf")
    total = offset
    node_of = torch.full((R, total + 1), -1, dtype=torch.int64, device=device)
    node_of.scatter_(
        1, torch.where(chosen, pick, total), torch.arange(1, width + 1, device=device).expand(R, -1)
    )
    level = torch.cat(levels)[pick]
    parent_flat = torch.cat(parents, 1).gather(1, pick)
    parent = torch.where(parent_flat >= 0, node_of.gather(1, parent_flat.clamp(min=0)), 0)
    rank = torch.cat(token_ranks, 1).gather(1, pick)
    batch = torch.arange(R, device=device)[:, None]
    pad = budget - width

    def padded(t: torch.Tensor, fill) -> torch.Tensor:
        t = torch.where(chosen, t, fill)
        return torch.nn.functional.pad(t, (0, pad), value=fill)

    return _Prefixes(
        chosen=torch.nn.functional.pad(chosen, (0, pad), value=False),
        depth=padded(level + 1, 0),
        parent=padded(parent, -1),
        rank=padded(rank, 0),
        pool_index=padded(order[batch, level, rank], 0),
        logq=padded(sorted_logp[batch, level, rank], 0.0),
    )


def _assemble(
    root_tokens: torch.Tensor,
    shape: _Prefixes,
    drafted: torch.Tensor,
    logq: torch.Tensor,
    max_depth: int,
) -> DraftTree:
    R = root_tokens.shape[0]
    zero = torch.zeros(R, 1, dtype=torch.int64, device=root_tokens.device)
    return DraftTree(
        tokens=torch.cat([root_tokens[:, None], drafted], 1),
        parents=torch.cat([zero - 1, shape.parent], 1).to(torch.int32),
        depths=torch.cat([zero, shape.depth], 1).to(torch.int32),
        num_nodes=(1 + shape.chosen.sum(1)).to(torch.int32),
        draft_logq=torch.cat([zero.float(), logq], 1),
        max_depth=max_depth,
    )


def _check_int(name: str, value, low: int, high: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (
        high is not None and value > high
    ):
        allowed = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be an int {allowed}, got {value!r}")


def _check_inputs(
    root_tokens: torch.Tensor,
    pool_ids: torch.Tensor,
    pool_logits: torch.Tensor | None,
    budget: int,
    validate: bool,
) -> None:
    if pool_ids.dim() != 3 or pool_ids.dtype != torch.int64 or min(pool_ids.shape[1:]) < 1:
        raise ValueError(
            f"pool_ids must be int64 [R, D, P] with D, P >= 1, got {pool_ids.dtype} "
            f"{list(pool_ids.shape)}"
        )
    R = pool_ids.shape[0]
    if root_tokens.shape != (R,) or root_tokens.dtype != torch.int64:
        raise ValueError(
            f"root_tokens must be int64 [R={R}], got {root_tokens.dtype} {list(root_tokens.shape)}"
        )
    if root_tokens.device != pool_ids.device:
        raise ValueError(f"root_tokens is on {root_tokens.device}, pool_ids on {pool_ids.device}")
    if pool_logits is not None:
        if pool_logits.shape != pool_ids.shape or not pool_logits.is_floating_point():
            raise ValueError(
                f"pool_logits must be floating with pool_ids' shape {list(pool_ids.shape)}, "
                f"got {pool_logits.dtype} {list(pool_logits.shape)}"
            )
        if pool_logits.device != pool_ids.device:
            raise ValueError(
                f"pool_logits is on {pool_logits.device}, pool_ids on {pool_ids.device}"
            )
    _check_int("budget", budget, 0, None)
    if not validate:
        return
    if bool((root_tokens < 0).any()):
        raise ValueError(f"root_tokens must be >= 0, got {root_tokens.tolist()}")
    if bool((pool_ids < 0).any()):
        raise ValueError("pool_ids must be >= 0")
    ordered = torch.sort(pool_ids, dim=-1).values
    if bool((ordered[..., 1:] == ordered[..., :-1]).any()):
        r, d = (ordered[..., 1:] == ordered[..., :-1]).any(-1).nonzero()[0].tolist()
        raise ValueError(f"pool_ids[{r}, {d}] holds a token twice: pool rows must be distinct ids")
    if pool_logits is not None:
        if bool((torch.isnan(pool_logits) | (pool_logits == float("inf"))).any()):
            raise ValueError("pool_logits must not hold NaN or +inf")
        if bool((pool_logits == float("-inf")).all(-1).any()):
            raise ValueError("pool_logits: every row needs a finite logit")
