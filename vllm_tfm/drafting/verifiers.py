"""Tree verification: one accepted root-to-node path plus a bonus token per request.

Inputs are a :class:`DraftTree` and the target's next-token distribution at
every node, ``probs`` [R, N, V] (row i = the distribution after node i's
path, temperature / top-k / top-p already applied; rows are normalised here
in float64). Randomness comes from per-request seeds ([R] int64) through
counter-based hashes (:func:`triton_ops.counter_random.counter_uniform`), so a
request's result depends only on its own seed, tree and probs. Derive a
fresh seed per step (:func:`vllm_tfm.drafting.tree.derive_seeds`).

Verifiers:

* greedy: follow the child whose token is the target's argmax; the bonus is
  the argmax at the deepest accepted node.
* target_only: at each node draw x ~ p(node); move to the child holding x,
  else stop with x as the bonus. The output is a target sample by
  construction, whatever the tree: lossless for every tree. It is run in
  the equivalent form "move to child c with probability p(c), else stop and
  draw the bonus from p off the children" (:func:`target_only_plan`), which
  needs p only at the children until the walk stops. For a tree that
  is a deterministic function of the drafter (chain, DDTree, Weaver
  best-first) it is also optimal: any lossless verifier accepts a path with
  probability at most its target probability, and this one reaches it for
  every path at once.
* traversal: Traversal Verification (Weng et al. 2025, arXiv 2505.12398),
  see :func:`traversal_plan`. Its gain over target_only needs trees whose
  children were SAMPLED from the draft distribution (the sampled builders of
  :mod:`vllm_tfm.drafting.builders`). On a
  deterministic tree it is run with the proposal "the drafter's q restricted
  to the retained children, visited in an order sampled without
  replacement"; it is lossless there too, but its outcome distribution then
  equals target_only's (lossless and a child token is never the bonus), at
  a higher cost.

The sampled verifiers are split into a randomness-free plan
(:func:`target_only_plan`, :func:`traversal_plan`: where the walk goes from
each node, and the bonus law where it stops) and :func:`walk_plan`, which
takes explicit uniforms, so tests can enumerate every outcome exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from triton_ops.counter_random import counter_gumbel, counter_uniform
from triton_ops.traversal import greedy_walk, sample_index, traversal_law, walk_choices
from vllm_tfm.drafting.tree import DraftTree

# counter_uniform streams (the sampled builder uses stream 1).
TARGET_ONLY_STREAM = 2
ORDER_STREAM = 3
CHOICE_STREAM = 4
BONUS_STREAM = 5


@dataclass(frozen=True)
class VerifyResult:
    """The accepted path of R requests; W = tree.max_depth + 1.

    Attributes:
        accepted_leaf: [R] int64 deepest accepted node (0 = only the root).
        accepted_len: [R] int64 drafted tokens accepted (root excluded).
        path: [R, W] int64 node indices root..leaf, -1 after the leaf.
        bonus_token: [R] int64 the token sampled after the leaf.
        output_tokens: [R, W] int64 the accepted drafted tokens then the bonus
            (accepted_len + 1 tokens), -1 after.
    """

    accepted_leaf: torch.Tensor
    accepted_len: torch.Tensor
    path: torch.Tensor
    bonus_token: torch.Tensor
    output_tokens: torch.Tensor


@dataclass(frozen=True)
class WalkPlan:
    """Where a sampled verifier's walk goes from each node, and the bonus law where it
    stops (float64). K+1 choices per node: its children in visiting order, then "stop
    here". S is the size of the support on which the bonus law is explicit.

    Attributes:
        children: [R, N, K] int64 children in visiting order, -1 padded.
        choice: [R, N, K+1] law of the walk's next move: into child j, or stop.
        support: [R, N, S] int64 support tokens, -1 padded.
        residual: [R, N, S] the bonus law at the node on the support.
        outside_scale: [R, N] the bonus law off the support is
            ``outside_scale * p(x)``.
    """

    children: torch.Tensor
    choice: torch.Tensor
    support: torch.Tensor
    residual: torch.Tensor
    outside_scale: torch.Tensor

    def expected_accepted(self, max_depth: int) -> torch.Tensor:
        """[R] float64 E[drafted tokens accepted]: the sum over drafted nodes of the
        probability that the walk passes them, carried from the root down one level a
        sweep (``max_depth``: the trees' depth limit)."""
        R, N, _ = self.children.shape
        batch = torch.arange(R, device=self.children.device)[:, None, None]
        present = self.children >= 0
        column = torch.where(present, self.children, N)  # column N takes the padding
        reach = torch.zeros(R, N + 1, dtype=torch.float64, device=self.choice.device)
        reach[:, 0] = 1
        for _ in range(max_depth):
            passed = torch.where(present, reach[:, :N, None] * self.choice[..., :-1], 0.0)
            reach = torch.zeros_like(reach).index_put_((batch.expand_as(column), column),
                                                       passed, accumulate=True)
            reach[:, 0] = 1
        return reach[:, 1:N].sum(-1)

    def bonus_distribution(self, probs: torch.Tensor, node: torch.Tensor) -> torch.Tensor:
        """[R, V] float64 law of the bonus token when ``node`` ([R]) stops the walk."""
        R, _, V = probs.shape
        batch = torch.arange(R, device=probs.device)
        row = probs[batch, node].double()
        law = row / _row_total(row) * self.outside_scale[batch, node, None]
        support = self.support[batch, node]
        law = torch.cat([law, law.new_zeros(R, 1)], 1)
        law.scatter_(1, torch.where(support >= 0, support, V), self.residual[batch, node])
        return law[:, :V]


@dataclass(frozen=True)
class TraversalPlan(WalkPlan):
    """Traversal verification's outcome law on one realised tree (float64).

    S is the proposal support size: K (the children) on deterministic trees, P (the
    pool row) on sampled trees. ``choice`` is the law of where the accepted path goes
    next given that the node's subtree accepts; ``residual`` the bonus law on the
    support after all the node's children were rejected.

    Attributes:
        alpha: [R, N] acceptance weight p_alpha a node is tested with.
        accept: [R, N] probability that the node's subtree accepts a path when
            tested with ``alpha``.
    """

    alpha: torch.Tensor
    accept: torch.Tensor


def verify_greedy(tree: DraftTree, target: torch.Tensor, validate: bool = True,
                  backend: str = "auto") -> VerifyResult:
    """Greedy verification. ``target``: [R, N, V] logits, log-probs or probs.

    Walk from the root into the child holding the node's argmax, with every node's
    argmax known up front (:func:`triton_ops.traversal.greedy_walk`; ``backend``: its
    kernel or PyTorch path). Sibling tokens are distinct, so at most one child of a node
    matches: the accepted nodes form one chain from the root.
    """
    _check_target(tree, target, "target", validate)
    picks = target.argmax(-1)  # [R, N]
    leaf, on_path = greedy_walk(tree.tokens, tree.parents, picks, tree.num_nodes,
                                tree.max_depth, backend)
    return _finish(tree, leaf, picks.gather(1, leaf[:, None])[:, 0], on_path)


def verify_target_only(
    tree: DraftTree, probs: torch.Tensor, seeds: torch.Tensor, validate: bool = True,
    backend: str = "auto",
) -> VerifyResult:
    """Target-only verification (lossless for any tree). ``probs``: [R, N, V];
    ``backend``: of the walk (:func:`triton_ops.traversal.walk_choices`) and the random
    numbers."""
    _check_target(tree, probs, "probs", validate)
    _check_seeds(tree, seeds)
    nodes = _node_ids(tree)
    return walk_plan(
        tree,
        target_only_plan(tree, probs),
        probs,
        counter_uniform(seeds, TARGET_ONLY_STREAM, nodes, backend=backend),
        counter_uniform(seeds, BONUS_STREAM, nodes[:, :1], backend=backend)[:, 0],
        backend,
    )


def target_only_plan(tree: DraftTree, probs: torch.Tensor) -> WalkPlan:
    """Target-only's walk: from node v into child c with probability p_v(c) (children in
    node order), else stop, the bonus then drawn from p_v off v's children. The same
    law as drawing x ~ p_v and moving to the child holding x (stopping with x as the
    bonus when none does)."""
    R, N = tree.tokens.shape
    batch = torch.arange(R, device=probs.device)[:, None, None]
    children, _ = tree.children(N - 1)
    present = children >= 0
    support = torch.where(present, tree.tokens[batch, children.clamp(min=0)], -1)
    into = torch.where(present, probs.gather(-1, support.clamp(min=0)).double(), 0.0)
    into = into / _row_total(probs)
    stop = _outside_mass(into)
    return WalkPlan(
        children=children,
        choice=torch.cat([into, stop[..., None]], -1),
        support=support,
        residual=torch.zeros_like(into),
        outside_scale=torch.where(stop > 0, 1 / torch.where(stop > 0, stop, 1.0), 0.0),
    )


def verify_traversal(
    tree: DraftTree, probs: torch.Tensor, seeds: torch.Tensor, validate: bool = True,
    backend: str = "auto",
) -> VerifyResult:
    """Traversal verification; sibling order sampled on deterministic trees.

    On a deterministic tree each node's children are visited in the order of
    ``draft_logq + Gumbel`` (sampling without replacement from q restricted to
    the children); sampled trees are visited in their sample (node) order.
    Nothing is read back from the device. ``backend``: of the per-node sweeps
    (:mod:`triton_ops.traversal`) and the random numbers ("auto": Triton on CUDA).
    """
    _check_target(tree, probs, "probs", validate)
    _check_seeds(tree, seeds)
    nodes = _node_ids(tree)
    keys = None
    if not tree.sampled:
        keys = tree.draft_logq.double() + counter_gumbel(seeds, ORDER_STREAM, nodes, backend)
    plan = traversal_plan(tree, probs, keys, backend)
    return walk_plan(
        tree,
        plan,
        probs,
        counter_uniform(seeds, CHOICE_STREAM, nodes, backend=backend),
        counter_uniform(seeds, BONUS_STREAM, nodes[:, :1], backend=backend)[:, 0],
        backend,
    )


# Target mass off a pool below this is rounding, not mass (pools hold at most 512 ids).
OUTSIDE_MASS_FLOOR = 1e-12


def traversal_plan(
    tree: DraftTree, probs: torch.Tensor, sibling_keys: torch.Tensor | None = None,
    backend: str = "auto",
) -> TraversalPlan:
    """Traversal verification's exact outcome law on a realised tree.

    The algorithm (Weng et al., Algorithm 1) repeatedly tests the first leaf
    of a post-order depth-first walk (children in visiting order). A node x
    under a parent in state (alpha_u, p_u, q_u) is tested with weight
    alpha_x = min(1, alpha_u p_u(x) / q_u(x));
    the path to a tested leaf is accepted with probability alpha_leaf, the
    bonus then drawn from p at the leaf. When a node x is rejected and
    deleted, its parent's state becomes

        Z       = sum_v [alpha_u p_u(v) - q_u(v)]_+
        p_u    <- [alpha_u p_u - q_u]_+ / Z
        alpha_u <- Z / (1 - alpha_u + Z)
        q_u    <- q_u without x, renormalised          (sampling w/o replacement)

    and the parent becomes a leaf once all its children are gone. Induction
    over the tree gives: if each node's children are an ordered sample
    without replacement from q_u (so the next child is distributed as the
    current q_u) and subtrees are drawn independently given their paths,
    a node tested with alpha accepts continuation s with probability
    alpha * P_target(s) and is rejected with probability 1 - alpha; at the
    root (alpha = 1) the output is an exact target sample.

    Rather than replaying coins leaf by leaf, this computes the same outcome
    law top-down: every state update depends only on the tree, so the
    alphas of all nodes follow from one pass over the nodes, subtree
    acceptance probabilities A from the deepest nodes upward
    (A_v = sum_j prod_{i<j}(1 - A_ci) A_cj + prod_i(1 - A_ci) alpha'_v,
    alpha'_v after all children's rejections), and the walk draws at each
    node "child j" or "stop" with those probabilities over A_v. Those sweeps
    are :func:`triton_ops.traversal.traversal_law` (one launch per request
    batch on CUDA). Loop counts come from the trees' shapes (N nodes,
    max_depth), so nothing is read back from the device; the plan's K is
    N - 1, the most children a node can have.

    Proposals: sampled trees use ``proposal_logq`` over the node's pool row
    (children in node order = sample order). Deterministic trees use q
    restricted to the retained children and renormalised, visited in the
    order of ``sibling_keys`` ([R, N] float, per-node key, descending); a
    child whose restricted q underflows to 0 is treated as not drafted.

    Args:
        tree: the draft trees.
        probs: [R, N, V] target probabilities per node.
        sibling_keys: [R, N] visiting-order keys, deterministic trees only;
            None visits children in node order.
        backend: of the sweeps (:func:`triton_ops.traversal.traversal_law`).
    """
    R, N = tree.tokens.shape
    device = tree.tokens.device
    batch = torch.arange(R, device=device)[:, None, None]
    children, _ = tree.children(N - 1)
    K = children.shape[2]
    present = children >= 0
    if sibling_keys is not None:
        if tree.sampled:
            raise ValueError(
                "sibling_keys must be None for sampled trees (children are in sample order)"
            )
        if sibling_keys.shape != (R, N):
            raise ValueError(
                f"sibling_keys must have shape [{R}, {N}], got {list(sibling_keys.shape)}"
            )
        keys = torch.where(present, sibling_keys[batch, children.clamp(min=0)], float("-inf"))
        # Stable: padding (at the end, key -inf) stays behind every real child.
        children = children.gather(-1, torch.sort(keys, dim=-1, descending=True, stable=True)[1])
        present = children >= 0
    child_token = torch.where(present, tree.tokens[batch, children.clamp(min=0)], -1)

    if tree.sampled:
        pool = tree.pool_ids
        support = pool[batch[..., 0], tree.depths.long().clamp(max=pool.shape[1] - 1)]
        proposal = _softmax_or_zero(tree.proposal_logq.double())
        # Each node's slot in the pool row it was drawn from (its parent's support).
        parent = tree.parents.long().clamp(min=0)[..., None].expand_as(support)
        drawn_from = support.gather(1, parent)
        match = drawn_from == tree.tokens[..., None]
        slot = torch.where(match.any(-1), match.long().argmax(-1), -1)
        child_pos = torch.where(present, slot[batch, children.clamp(min=0)], -1)
    else:
        support = child_token
        logq = torch.where(present, tree.draft_logq[batch, children.clamp(min=0)], float("-inf"))
        proposal = _softmax_or_zero(logq.double())
        child_pos = torch.where(present, torch.arange(K, device=device), -1)
    total = _row_total(probs)
    target = torch.where(support >= 0, probs.gather(-1, support.clamp(min=0)).double(), 0.0)
    target = target / total
    outside = _outside_mass(target)

    flat_children = torch.where(present, children, N).view(R, -1)
    rank = _per_node(torch.arange(K, device=device).expand(R, N, K), flat_children)
    # The root first (depth 0, rank -1), then by depth and visiting rank, padding last: a
    # node comes after its parent and after its earlier siblings.
    order = torch.argsort(torch.where(tree.valid, tree.depths.long() * N + rank, N * N),
                          dim=1, stable=True)
    law = traversal_law(torch.where(tree.valid, tree.parents.long(), -1), order, children,
                        _per_node(child_pos, flat_children), target, outside, proposal,
                        tree.max_depth, backend)
    return TraversalPlan(
        children=children,
        alpha=law.alpha,
        accept=law.accept,
        choice=law.choice,
        support=support,
        residual=law.residual,
        outside_scale=law.scale,
    )


def walk_plan(
    tree: DraftTree,
    plan: WalkPlan,
    probs: torch.Tensor,
    choice_uniforms: torch.Tensor,
    bonus_uniforms: torch.Tensor,
    backend: str = "auto",
) -> VerifyResult:
    """Sample the path and bonus from a plan with explicit randomness.

    Node i picks ``sample_index(plan.choice[:, i], choice_uniforms[:, i])``
    ([R, N] uniforms); the bonus is ``sample_index(bonus law, bonus_uniforms)``.
    ``backend``: of the walk (:func:`triton_ops.traversal.walk_choices`).
    """
    leaf, on_path = walk_choices(plan.choice, plan.children, choice_uniforms, tree.max_depth,
                                 backend)
    bonus = sample_index(plan.bonus_distribution(probs, leaf), bonus_uniforms)
    return _finish(tree, leaf, bonus, on_path)


def _outside_mass(on_support: torch.Tensor) -> torch.Tensor:
    """[R, N] target mass off the support, from its law on it ([R, N, S], normalised p).
    A support holding all of p leaves float64 rounding (~1e-16 per id), which would give
    the walk a ~1e-13 chance to stop where no bonus token has mass: below
    OUTSIDE_MASS_FLOOR it is 0."""
    outside = 1 - on_support.sum(-1)
    return torch.where(outside > OUTSIDE_MASS_FLOOR, outside, 0.0)


def _per_node(values: torch.Tensor, flat_children: torch.Tensor) -> torch.Tensor:
    """[R, N]: each node's entry of ``values`` ([R, N, K], by parent and visiting slot, as
    the children table); -1 for the root and padding nodes."""
    R, N = values.shape[:2]
    out = values.new_full((R, N + 1), -1)
    out.scatter_(1, flat_children, values.reshape(R, -1))
    return out[:, :N]


def _softmax_or_zero(logits: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim; rows without a finite entry give zeros."""
    if logits.shape[-1] == 0:
        return logits.clone()
    top = logits.amax(-1, keepdim=True)
    finite = top > float("-inf")
    weights = torch.exp(logits - torch.where(finite, top, 0.0))
    mass = weights.sum(-1, keepdim=True)
    return torch.where(finite, weights / torch.where(finite, mass, 1.0), 0.0)


def _row_total(rows: torch.Tensor) -> torch.Tensor:
    """[..., 1] float64 row sums, 1 for empty rows (padding nodes). Rows that are not
    float64 are summed in float32 (a relative error of ~1e-7, the rows' own) and widened
    after: summing them as float64 first casts the whole block, a [R, N, V] float64 copy
    (2 GiB for the engine's 1 GiB verification groups; it ran an H100 out of memory)."""
    accumulator = torch.float64 if rows.dtype == torch.float64 else torch.float32
    total = rows.sum(-1, keepdim=True, dtype=accumulator).double()
    return torch.where(total > 0, total, 1.0)


def _node_ids(tree: DraftTree) -> torch.Tensor:
    return torch.arange(tree.max_nodes, device=tree.tokens.device).expand(tree.batch_size, -1)


def _finish(tree: DraftTree, leaf: torch.Tensor, bonus: torch.Tensor,
            on_path: torch.Tensor | None = None) -> VerifyResult:
    """The result of stopping at ``leaf`` with ``bonus``; ``on_path`` [R, N] bool, the
    root-to-leaf nodes where the caller knows them (else walked up from the leaf)."""
    R = tree.batch_size
    width = tree.max_depth + 1
    device = leaf.device
    path = torch.full((R, width + 1), -1, dtype=torch.int64, device=device)
    parents, depths = tree.parents.long(), tree.depths.long()
    if on_path is not None:
        # Column ``width`` collects the other nodes and is dropped.
        path.scatter_(1, torch.where(on_path, depths, width), _node_ids(tree))
    else:
        node = leaf
        for _ in range(width):
            real = node >= 0
            at = node.clamp(min=0)[:, None]
            path.scatter_(1, torch.where(real[:, None], depths.gather(1, at), width),
                          node[:, None])
            node = torch.where(real, parents.gather(1, at)[:, 0], -1)
    path = path[:, :width]
    length = depths.gather(1, leaf[:, None])[:, 0]
    on_path = torch.where(path >= 0, tree.tokens.gather(1, path.clamp(min=0)), -1)
    output = torch.cat([on_path[:, 1:], torch.full_like(on_path[:, :1], -1)], 1)
    output.scatter_(1, length[:, None], bonus[:, None])
    return VerifyResult(
        accepted_leaf=leaf,
        accepted_len=length,
        path=path,
        bonus_token=bonus,
        output_tokens=output,
    )


def _check_target(tree: DraftTree, target: torch.Tensor, name: str, validate: bool) -> None:
    R, N = tree.tokens.shape
    if target.dim() != 3 or tuple(target.shape[:2]) != (R, N) or target.shape[2] < 1:
        raise ValueError(f"{name} must be [R={R}, N={N}, V], got {list(target.shape)}")
    if not target.is_floating_point():
        raise ValueError(f"{name} must be floating, got {target.dtype}")
    if target.device != tree.tokens.device:
        raise ValueError(f"{name} is on {target.device}, the tree on {tree.tokens.device}")
    if validate:
        tree.validate(vocab_size=target.shape[2])


def _check_seeds(tree: DraftTree, seeds: torch.Tensor) -> None:
    if seeds.shape != (tree.batch_size,) or seeds.dtype != torch.int64:
        raise ValueError(
            f"seeds must be int64 [R={tree.batch_size}], got {seeds.dtype} {list(seeds.shape)}"
        )
    if seeds.device != tree.tokens.device:
        raise ValueError(f"seeds is on {seeds.device}, the tree on {tree.tokens.device}")
