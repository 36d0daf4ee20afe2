"""The PyTorch path of traversal verification's sweeps: the CPU path and the kernels'
reference (the verifiers' enumeration tests check it against the exact target law).

Each loop step is a batch of small tensor ops over all requests at once; on a GPU every
one is a launch, which is why CUDA runs the kernels of :mod:`.traversal_triton`.
"""

from __future__ import annotations

import torch


def sample_index(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: [M, C] non-negative weights, [M] uniforms in [0, 1) -> [M] int64.

    Index i is returned iff ``cdf[i-1] <= u * total < cdf[i]`` (cdf of the
    float64 weights), so zero-weight entries are never returned.
    """
    cdf = weights.double().cumsum(-1)
    total = cdf[:, -1:]
    point = torch.minimum(uniforms.double()[:, None] * total, torch.nextafter(total, total * 0))
    return torch.searchsorted(cdf, point, right=True)[:, 0].clamp(max=weights.shape[1] - 1)


def visit_nodes_torch(parents, order, support_index, target, outside, proposal):
    """The sibling loops, one node of every request per step (see
    :func:`triton_ops.traversal.traversal_law` for the arguments and the update rule).

    Returns alpha, last_alpha [R, N], residual [R, N, S], scale [R, N].
    """
    R, N = parents.shape
    rows = torch.arange(R, device=target.device)
    weight = torch.zeros(R, N, dtype=torch.float64, device=target.device)
    weight[:, 0] = 1
    alpha = weight.clone()
    residual, scale, q = target.clone(), torch.ones_like(weight), proposal.clone()
    for k in range(1, N):
        node = order[:, k]
        parent = parents[rows, node]
        up = parent.clamp(min=0)
        pos = support_index[rows, node]
        a, p, s, q_u = weight[rows, up], residual[rows, up], scale[rows, up], q[rows, up]
        at = pos.clamp(min=0)[:, None]
        q_x = q_u.gather(-1, at)[:, 0]
        # A zero-mass child cannot have been drawn: it is not part of the draft.
        real = (parent >= 0) & (pos >= 0) & (q_x > 0)
        p_x = p.gather(-1, at)[:, 0]
        ratio = a * p_x / torch.where(real, q_x, 1.0)
        node_alpha = torch.where(real, ratio.clamp(max=1), 0.0)
        excess = (a[:, None] * p - q_u).clamp(min=0)
        z = excess.sum(-1) + a * s * outside[rows, up]
        alive = real & (z > 0)
        z_safe = torch.where(alive, z, 1.0)
        left = q_u.scatter(-1, at, 0.0)
        left_mass = left.sum(-1, keepdim=True)
        new_q = torch.where(left_mass > 0, left / torch.where(left_mass > 0, left_mass, 1.0), 0.0)
        # With z = 0 the rejection has probability 0: the state is never used.
        new_a = torch.where(alive, z / (1 - a + z_safe), 0.0)
        new_residual = torch.where(alive[:, None], excess / z_safe[:, None], 0.0)
        new_scale = torch.where(alive, a * s / z_safe, 0.0)
        weight[rows, up] = torch.where(real, new_a, a)
        residual[rows, up] = torch.where(real[:, None], new_residual, p)
        scale[rows, up] = torch.where(real, new_scale, s)
        q[rows, up] = torch.where(real[:, None], new_q, q_u)
        alpha[rows, node] = node_alpha
        weight[rows, node] = node_alpha
    return alpha, weight, residual, scale


def subtree_accept_torch(children, last_alpha, max_depth):
    """Subtree acceptance A and the choice law, by ``max_depth + 1`` upward passes over
    every node at once (pass t makes A exact t levels above the deepest nodes).

    Returns accept [R, N] and choice [R, N, K + 1]."""
    R, N, K = children.shape
    present = children >= 0
    accept = last_alpha
    for _ in range(max_depth + 1):
        child_accept = torch.where(
            present, accept.gather(1, children.clamp(min=0).view(R, -1)).view(R, N, K), 0.0
        )
        survive = torch.cumprod(1 - child_accept, dim=-1)
        before = torch.cat([torch.ones_like(survive[..., :1]), survive[..., :-1]], -1)
        after_all = survive[..., -1] if K else torch.ones_like(accept)
        accept = (before * child_accept).sum(-1) + after_all * last_alpha
    stop = after_all * last_alpha
    choice = torch.cat([before * child_accept, stop[..., None]], -1)
    return accept, choice / torch.where(accept > 0, accept, 1.0)[..., None]


def walk_choices_torch(choice, children, uniforms, max_depth):
    """Descend from the root, node i picking ``sample_index(choice[:, i], uniforms[:, i])``.

    Returns leaf [R] int64 and on_path [R, N] bool."""
    R, N, K = children.shape
    batch = torch.arange(R, device=choice.device)
    node = torch.zeros(R, dtype=torch.int64, device=choice.device)
    done = torch.zeros(R, dtype=torch.bool, device=choice.device)
    on_path = torch.zeros(R, N, dtype=torch.bool, device=choice.device)
    on_path[:, 0] = True
    for _ in range(max_depth + 1):
        pick = sample_index(choice[batch, node], uniforms[batch, node])
        done = done | (pick >= K)
        if K:
            step = children[batch, node, pick.clamp(max=K - 1)]
            node = torch.where(done, node, step)
            on_path[batch, node] = True
    return node, on_path


def greedy_walk_torch(tokens, parents, picks, num_nodes, max_depth):
    """Greedy's path in a fixed number of tensor ops (no step per depth): a node is on
    it iff its token is its parent's pick and so is every ancestor's; siblings differ,
    so those nodes form one chain from the root, and the leaf (the deepest) is the last
    in node order. Returns leaf [R] int64 and on_path [R, N] bool."""
    node = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    on_path = (parents >= 0) & (tokens == picks.gather(1, parents.clamp(min=0)))
    on_path = (on_path & (node < num_nodes.view(-1, 1))) | (node == 0)
    # Pointer jumping: after k rounds each node has checked its 2^k nearest ancestors.
    jump = parents
    for _ in range(max(1, max_depth.bit_length())):
        has_jump = jump >= 0
        at = jump.clamp(min=0)
        on_path = on_path & (on_path.gather(1, at) | ~has_jump)
        jump = torch.where(has_jump, jump.gather(1, at), jump)
    return torch.where(on_path, node, -1).amax(-1), on_path
