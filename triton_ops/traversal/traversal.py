"""The verifiers' per-node sweeps: Traversal Verification (Weng et al. 2025,
arXiv 2505.12398) and the walk that target-only verification shares with it.

The algorithms and their exact outcome laws are in :mod:`vllm_tfm.drafting.verifiers`;
this op holds the parts that go node by node, so that a GPU runs them as one launch per
sweep instead of a dozen launches per node:

* :func:`traversal_law`: every node's acceptance weight and its state after its
  children's rejections (the sibling loops), then subtree acceptance and the law of
  where an accepted path goes next;
* :func:`walk_choices`: the descent that samples such a law from the root (traversal's,
  or target-only's: into child c with probability p(c), else stop);
* :func:`greedy_walk`: greedy verification's descent, into the child holding the node's
  target argmax while one does.

CUDA tensors run the kernels of :mod:`.traversal_triton`, CPU tensors the PyTorch path
of :mod:`.traversal_torch` (see :func:`triton_ops.utils.use_triton`). Everything is
float64: the verifiers are tested exact to 1e-10.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from triton_ops.utils import INDEX_DTYPES, check_same_device, use_triton


@dataclass(frozen=True)
class TraversalLaw:
    """Per node of R requests with N nodes (float64).

    Attributes:
        alpha: [R, N] weight the node is tested with (1 at the root, 0 at nodes
            that are not drafted).
        last_alpha: [R, N] the node's weight once all its children were rejected.
        residual: [R, N, S] the node's residual target on its support at that point.
        scale: [R, N] the residual target off the support is ``scale * p``.
        accept: [R, N] probability that the node's subtree accepts a path when the
            node is tested with ``alpha``.
        choice: [R, N, K + 1] given that it accepts, the law of where the path goes:
            into child j's subtree, or stop at the node (last column).
    """

    alpha: torch.Tensor
    last_alpha: torch.Tensor
    residual: torch.Tensor
    scale: torch.Tensor
    accept: torch.Tensor
    choice: torch.Tensor


def traversal_law(
    parents: torch.Tensor,
    order: torch.Tensor,
    children: torch.Tensor,
    support_index: torch.Tensor,
    target: torch.Tensor,
    outside: torch.Tensor,
    proposal: torch.Tensor,
    max_depth: int,
    backend: str = "auto",
) -> TraversalLaw:
    """Run the sibling loops of every node, then subtree acceptance.

    A node x under a parent in state (alpha_u, p_u, q_u) is tested with
    ``alpha_x = min(1, alpha_u p_u(x) / q_u(x))``. Its rejection updates the parent to
    ``Z = sum_v [alpha_u p_u(v) - q_u(v)]_+`` (the off-support part included),
    ``p_u <- [alpha_u p_u - q_u]_+ / Z``, ``alpha_u <- Z / (1 - alpha_u + Z)`` and q_u
    without x, renormalised. A child whose q is 0 is not part of the draft. Then
    ``A_v = sum_j prod_{i<j} (1 - A_ci) A_cj + prod_i (1 - A_ci) last_alpha_v`` over v's
    children c_0, c_1, ... in visiting order.

    Args:
        parents: [R, N] int64 parent of each node; -1 at the root and padding nodes.
        order: [R, N] int64 a permutation of the nodes: the root first, every node
            after its parent and after its earlier siblings, padding nodes last.
        children: [R, N, K] int64 each node's children in visiting order, -1 padded.
        support_index: [R, N] int64 each node's slot in its parent's support; -1: none.
        target: [R, N, S] float64 the target law at each node on its support.
        outside: [R, N] float64 the target mass off the support.
        proposal: [R, N, S] float64 the proposal q at each node on its support.
        max_depth: no node is deeper (the PyTorch path's number of upward passes).
        backend: ``"auto"``, ``"torch"`` or ``"triton"``.
    """
    R, N = parents.shape
    for name, t in (("parents", parents), ("order", order), ("support_index", support_index),
                    ("outside", outside)):
        if t.shape != (R, N):
            raise ValueError(f"{name} must be [R={R}, N={N}], got {list(t.shape)}")
    if children.dim() != 3 or children.shape[:2] != (R, N):
        raise ValueError(f"children must be [R={R}, N={N}, K], got {list(children.shape)}")
    if target.dim() != 3 or target.shape[:2] != (R, N) or proposal.shape != target.shape:
        raise ValueError(f"target and proposal must share one shape [R={R}, N={N}, S], got "
                         f"{list(target.shape)} and {list(proposal.shape)}")
    _check_index("parents", parents, "order", order, "children", children,
                 "support_index", support_index)
    _check_float64("target", target, "outside", outside, "proposal", proposal)
    check_same_device("target", target, parents=parents, order=order, children=children,
                      support_index=support_index, outside=outside, proposal=proposal)
    if use_triton(backend, target):
        from triton_ops.traversal.traversal_triton import law_triton

        index = [t.long().contiguous() for t in (parents, order, children, support_index)]
        parts = law_triton(*index, target.contiguous(), outside.contiguous(),
                           proposal.contiguous())
        return TraversalLaw(*parts)
    from triton_ops.traversal.traversal_torch import subtree_accept_torch, visit_nodes_torch

    alpha, last_alpha, residual, scale = visit_nodes_torch(
        parents.long(), order.long(), support_index.long(), target, outside, proposal)
    accept, choice = subtree_accept_torch(children.long(), last_alpha, max_depth)
    return TraversalLaw(alpha, last_alpha, residual, scale, accept, choice)


def walk_choices(
    choice: torch.Tensor,
    children: torch.Tensor,
    uniforms: torch.Tensor,
    max_depth: int,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample a path from the root: at node i, ``sample_index(choice[:, i],
    uniforms[:, i])`` (:func:`triton_ops.traversal.sample_index`) picks child j's
    subtree, or stop (the last column).

    Args:
        choice: [R, N, K + 1] float64 (:attr:`TraversalLaw.choice`).
        children: [R, N, K] int64 each node's children in visiting order, -1 padded.
        uniforms: [R, N] float in [0, 1).
        max_depth: no node is deeper.

    Returns:
        leaf [R] int64, the node the path stops at; on_path [R, N] bool, the nodes of
        the path root..leaf.
    """
    if children.dim() != 3:
        raise ValueError(f"children must be [R, N, K], got {list(children.shape)}")
    R, N, K = children.shape
    if choice.shape != (R, N, K + 1):
        raise ValueError(f"choice must be [R={R}, N={N}, K+1={K + 1}], got {list(choice.shape)}")
    if uniforms.shape != (R, N) or not uniforms.is_floating_point():
        raise ValueError(f"uniforms must be a float [R={R}, N={N}] tensor, got {uniforms.dtype} "
                         f"{list(uniforms.shape)}")
    _check_index("children", children)
    _check_float64("choice", choice)
    check_same_device("choice", choice, children=children, uniforms=uniforms)
    if use_triton(backend, choice):
        from triton_ops.traversal.traversal_triton import walk_triton

        return walk_triton(choice.contiguous(), children.long().contiguous(),
                           uniforms.contiguous(), max_depth)
    from triton_ops.traversal.traversal_torch import walk_choices_torch

    return walk_choices_torch(choice, children.long(), uniforms, max_depth)


def greedy_walk(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    picks: torch.Tensor,
    num_nodes: torch.Tensor,
    max_depth: int,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification's path: from the root into the child whose token is the
    node's pick (its target argmax), while one is.

    Args:
        tokens: [R, N] each node's token; sibling tokens are distinct, so at most one
            child matches.
        parents: [R, N] each node's parent, -1 at the root; parents precede their
            children (topological order).
        picks: [R, N] int each node's target argmax.
        num_nodes: [R] real nodes per tree (the rest is padding, never on the path).
        max_depth: no node is deeper.

    Returns:
        leaf [R] int64, the deepest node of the path; on_path [R, N] bool, root..leaf.
    """
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be [R, N], got {list(tokens.shape)}")
    R, N = tokens.shape
    for name, t in (("parents", parents), ("picks", picks)):
        if t.shape != (R, N):
            raise ValueError(f"{name} must be [R={R}, N={N}], got {list(t.shape)}")
    if num_nodes.shape != (R,):
        raise ValueError(f"num_nodes must be [R={R}], got {list(num_nodes.shape)}")
    _check_index("tokens", tokens, "parents", parents, "picks", picks, "num_nodes", num_nodes)
    check_same_device("tokens", tokens, parents=parents, picks=picks, num_nodes=num_nodes)
    if use_triton(backend, tokens):
        from triton_ops.traversal.traversal_triton import greedy_walk_triton

        return greedy_walk_triton(tokens.contiguous(), parents.contiguous(), picks.contiguous(),
                                  num_nodes.contiguous(), max_depth)
    from triton_ops.traversal.traversal_torch import greedy_walk_torch

    return greedy_walk_torch(tokens, parents.long(), picks, num_nodes, max_depth)


def _check_index(*named) -> None:
    for name, t in zip(named[::2], named[1::2]):
        if t.dtype not in INDEX_DTYPES:
            raise ValueError(f"{name} must be int32/int64, got {t.dtype}")


def _check_float64(*named) -> None:
    for name, t in zip(named[::2], named[1::2]):
        if t.dtype != torch.float64:
            raise ValueError(f"{name} must be float64, got {t.dtype}")
