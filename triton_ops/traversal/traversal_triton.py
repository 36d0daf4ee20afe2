"""Traversal verification's sweeps as one program per request.

The PyTorch path runs each node of the sibling loop, each upward pass and each step of
the walk as a dozen launches over the batch: about 6k launches a step at budget 64 on
the GPU, where model runner V2 verifies eagerly. Here a request's program walks its
nodes in a loop instead. Per-node scalars (weights, scales, the order) stay in registers;
a node's state rows (S float64 values, up to the 512 of a pool row) and the subtree
acceptances live in global memory, written by one step and read by the next, and
``tl.debug_barrier`` orders those accesses across the program's threads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _product(a, b):
    return a * b


@triton.jit
def _entry(values, lanes, at):
    """``values[at]`` of a register vector (one lane selected, the others summed as 0)."""
    return tl.sum(tl.where(lanes == at, values, 0), 0)


@triton.jit
def _law_kernel(
    order_ptr, parents_ptr, children_ptr, support_index_ptr, outside_ptr,
    weight_ptr, alpha_ptr, residual_ptr, scale_ptr, q_ptr, accept_ptr, choice_ptr,
    N, S, K,
    BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr,
):
    base = tl.program_id(0).to(tl.int64) * N
    # Per-node scalars live in registers; the rows of S values (residual, q) in memory.
    n = tl.arange(0, BLOCK_N)
    n_mask = n < N
    order = tl.load(order_ptr + base + n, mask=n_mask, other=0)
    parents = tl.load(parents_ptr + base + n, mask=n_mask, other=-1)
    support_index = tl.load(support_index_ptr + base + n, mask=n_mask, other=-1)
    outside = tl.load(outside_ptr + base + n, mask=n_mask, other=0.0)
    weight = tl.where(n == 0, 1.0, tl.zeros([BLOCK_N], dtype=tl.float64))
    alpha = weight
    scale = tl.full([BLOCK_N], 1.0, dtype=tl.float64)
    s = tl.arange(0, BLOCK_S)
    s_mask = s < S
    # The sibling loops: node ``order[k]`` is tested, then rejected from its parent's state.
    for k in range(1, N):
        node = _entry(order, n, k)
        parent = _entry(parents, n, node)
        up = tl.maximum(parent, 0)
        pos = _entry(support_index, n, node)
        a = _entry(weight, n, up)
        sc = _entry(scale, n, up)
        row = (base + up) * S
        p = tl.load(residual_ptr + row + s, mask=s_mask, other=0.0)
        q_u = tl.load(q_ptr + row + s, mask=s_mask, other=0.0)
        is_x = s == pos
        q_x = tl.sum(tl.where(is_x, q_u, 0.0), 0)
        p_x = tl.sum(tl.where(is_x, p, 0.0), 0)
        real = (parent >= 0) & (pos >= 0) & (q_x > 0)
        node_alpha = tl.where(real, tl.minimum(a * p_x / tl.where(real, q_x, 1.0), 1.0), 0.0)
        excess = tl.maximum(a * p - q_u, 0.0)
        z = tl.sum(excess, 0) + a * sc * _entry(outside, n, up)
        alive = real & (z > 0)
        z_safe = tl.where(alive, z, 1.0)
        left = tl.where(is_x, 0.0, q_u)
        left_mass = tl.sum(left, 0)
        new_q = tl.where(left_mass > 0, left / tl.where(left_mass > 0, left_mass, 1.0), 0.0)
        # The parent's state changes only when a real child was rejected.
        parent_lane = n == tl.where(real, up, -1)
        weight = tl.where(parent_lane, tl.where(alive, z / (1 - a + z_safe), 0.0), weight)
        scale = tl.where(parent_lane, tl.where(alive, a * sc / z_safe, 0.0), scale)
        weight = tl.where(n == node, node_alpha, weight)
        alpha = tl.where(n == node, node_alpha, alpha)
        updated = s < tl.where(real, S, 0)
        tl.store(residual_ptr + row + s, tl.where(alive, excess / z_safe, 0.0), mask=updated)
        tl.store(q_ptr + row + s, new_q, mask=updated)
        tl.debug_barrier()
    tl.store(weight_ptr + base + n, weight, mask=n_mask)
    tl.store(alpha_ptr + base + n, alpha, mask=n_mask)
    tl.store(scale_ptr + base + n, scale, mask=n_mask)
    # Subtree acceptance, deepest nodes first: a node's children are final before it.
    j = tl.arange(0, BLOCK_K)
    j_mask = j < K
    for i in range(0, N):
        v = _entry(order, n, N - 1 - i)
        children = children_ptr + (base + v) * K
        child = tl.load(children + j, mask=j_mask, other=-1)
        child_accept = tl.load(accept_ptr + base + child, mask=child >= 0, other=0.0)
        # Child j - 1's acceptance, for the probability that children 0..j-1 all reject.
        previous = tl.load(children + j - 1, mask=j_mask & (j > 0), other=-1)
        previous_accept = tl.load(accept_ptr + base + previous, mask=previous >= 0, other=0.0)
        before = tl.cumprod(1.0 - previous_accept, 0)
        into_child = before * child_accept
        stop = tl.reduce(1.0 - child_accept, 0, _product) * _entry(weight, n, v)
        accept = tl.sum(into_child, 0) + stop
        accept_safe = tl.where(accept > 0, accept, 1.0)
        tl.store(accept_ptr + base + v, accept)
        choice = choice_ptr + (base + v) * (K + 1)
        tl.store(choice + j, into_child / accept_safe, mask=j_mask)
        tl.store(choice + K, stop / accept_safe)
        tl.debug_barrier()


@triton.jit
def _walk_kernel(
    choice_ptr, children_ptr, uniforms_ptr, leaf_ptr, on_path_ptr,
    N, K, steps,
    BLOCK_C: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    base = r * N
    c = tl.arange(0, BLOCK_C)
    c_mask = c < K + 1
    node = tl.zeros((), dtype=tl.int64)
    done = node != 0
    tl.store(on_path_ptr + base, 1)
    for _ in range(steps):
        weights = tl.load(choice_ptr + (base + node) * (K + 1) + c, mask=c_mask, other=0.0)
        cdf = tl.cumsum(weights, 0)
        total = tl.max(tl.where(c_mask, cdf, 0.0), 0)
        # The largest double below the total: u * total can round up to it.
        below = (total.to(tl.int64, bitcast=True) - 1).to(tl.float64, bitcast=True)
        u = tl.load(uniforms_ptr + base + node).to(tl.float64)
        point = tl.minimum(u * total, tl.where(total > 0, below, total))
        pick = tl.minimum(tl.sum((c_mask & (cdf <= point)).to(tl.int64), 0), K)
        done = done | (pick >= K)
        child = tl.load(children_ptr + (base + node) * K + tl.minimum(pick, K - 1), mask=K > 0,
                        other=0)
        node = tl.where(done, node, child)
        tl.store(on_path_ptr + base + node, 1)
    tl.store(leaf_ptr + r, node)


@triton.jit
def _greedy_walk_kernel(
    tokens_ptr, parents_ptr, picks_ptr, num_nodes_ptr, leaf_ptr, on_path_ptr,
    N, steps,
    BLOCK_N: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    base = r * N
    n = tl.arange(0, BLOCK_N)
    # Padding nodes read as parent -2 and token -1: never a match.
    real = n < tl.load(num_nodes_ptr + r)
    tokens = tl.load(tokens_ptr + base + n, mask=real, other=-1)
    parents = tl.load(parents_ptr + base + n, mask=real, other=-2)
    node = tl.zeros((), dtype=tl.int64)
    on_path = n == 0
    for _ in range(steps):
        # Siblings differ: one child at most holds the pick. Once none does, the node
        # and its pick stay, and so do the later steps.
        pick = tl.load(picks_ptr + base + node)
        child = tl.max(tl.where((parents == node) & (tokens == pick), n, -1), 0)
        node = tl.where(child >= 0, child, node)
        on_path = on_path | (n == child)
    tl.store(on_path_ptr + base + n, on_path, mask=n < N)
    tl.store(leaf_ptr + r, node)


def law_triton(parents, order, children, support_index, target, outside, proposal):
    """Arguments and results as :func:`triton_ops.traversal.traversal_law` (contiguous)."""
    R, N, K = children.shape
    S = target.shape[2]
    device = target.device
    weight, alpha, scale, accept = (torch.empty(R, N, dtype=torch.float64, device=device)
                                    for _ in range(4))
    residual, q = target.clone(), proposal.clone()
    choice = torch.empty(R, N, K + 1, dtype=torch.float64, device=device)
    if R:
        _law_kernel[(R,)](
            order, parents, children, support_index, outside,
            weight, alpha, residual, scale, q, accept, choice,
            N, S, K,
            BLOCK_N=triton.next_power_of_2(N), BLOCK_S=triton.next_power_of_2(max(S, 1)),
            BLOCK_K=triton.next_power_of_2(max(K, 1)),
        )
    return alpha, weight, residual, scale, accept, choice


def walk_triton(choice, children, uniforms, max_depth):
    """Arguments and results as :func:`triton_ops.traversal.walk_choices` (contiguous)."""
    R, N, K = children.shape
    leaf = torch.empty(R, dtype=torch.int64, device=choice.device)
    on_path = torch.zeros(R, N, dtype=torch.bool, device=choice.device)
    if R:
        _walk_kernel[(R,)](
            choice, children, uniforms, leaf, on_path, N, K, max_depth + 1,
            BLOCK_C=triton.next_power_of_2(K + 1),
        )
    return leaf, on_path


def greedy_walk_triton(tokens, parents, picks, num_nodes, max_depth):
    """Arguments and results as :func:`triton_ops.traversal.greedy_walk` (contiguous)."""
    R, N = tokens.shape
    leaf = torch.empty(R, dtype=torch.int64, device=tokens.device)
    on_path = torch.empty(R, N, dtype=torch.bool, device=tokens.device)
    if R:
        _greedy_walk_kernel[(R,)](tokens, parents, picks, num_nodes, leaf, on_path, N, max_depth,
                                  BLOCK_N=triton.next_power_of_2(N))
    return leaf, on_path
