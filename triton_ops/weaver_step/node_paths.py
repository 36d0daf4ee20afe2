"""Where the w nodes of one Weaver call sit in the round: their ancestors, cache slots
and positions, and their own path recorded for their future children.

A node's path is its parent's path plus itself at its own depth: ``paths[r, i, k]``
is the node index of node i's depth-k ancestor (i itself at its depth), -1 past
it. The Triton form is one program per node.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from triton_ops.utils import use_triton


class NodePlaces(NamedTuple):
    """ancestors: [R, w, D+1] int64 node indices of each node's strict ancestors
    (-1 = none); kv_slot: [R, w] int64 cache slot of the node's K/V (the scratch
    slot N for padding and depth-D nodes); positions: [R, w] int64, depth + 1
    (1 for rows that are not expanded); pool_row: [R, w] int64, the pool row of
    the node's children (its depth), -1 for rows that are not expanded;
    token_row: [R, w] int64 the node's token, 0 for padding rows (whose token
    field may hold anything)."""

    ancestors: torch.Tensor
    kv_slot: torch.Tensor
    positions: torch.Tensor
    pool_row: torch.Tensor
    token_row: torch.Tensor


def extend_paths(paths: torch.Tensor, node_depth: torch.Tensor, node_index: torch.Tensor,
                 tokens: torch.Tensor, parent_index: torch.Tensor, depths: torch.Tensor, *,
                 backend: str = "auto") -> NodePlaces:
    """Record the nodes' paths and depths; return their places.

    Args:
        paths: [R, N+1, D+1] int64, updated in place at the nodes' rows.
        node_depth: [R, N+1] int64 depth per node (-1 unseen), updated in place.
        node_index, tokens, parent_index, depths: [R, w] int64 as in ``WeaverRound.expand``
            (node -1 = padding; parents added by earlier calls).
    """
    R, slots, S = paths.shape
    if not (paths.is_contiguous() and node_depth.is_contiguous()):
        raise ValueError("paths and node_depth must be contiguous (they are written in place)")
    if not use_triton(backend, paths):
        return _torch_extend_paths(paths, node_depth, node_index, tokens, parent_index, depths)
    w = node_index.shape[1]
    ancestors = torch.empty(R, w, S, dtype=torch.int64, device=paths.device)
    kv_slot = torch.empty(R, w, dtype=torch.int64, device=paths.device)
    positions, pool_row, token_row = (torch.empty_like(kv_slot) for _ in range(3))
    if R * w:
        _extend_paths_kernel[(R * w,)](
            paths, node_depth, node_index.contiguous(), tokens.contiguous(),
            parent_index.contiguous(), depths.contiguous(), ancestors, kv_slot, positions,
            pool_row, token_row, w, slots, S, BLOCK_S=triton.next_power_of_2(S),
        )
    return NodePlaces(ancestors, kv_slot, positions, pool_row, token_row)


def _torch_extend_paths(paths, node_depth, node_index, tokens, parent_index, depths) -> NodePlaces:
    R, slots, S = paths.shape
    scratch, d_max = slots - 1, S - 1
    batch = torch.arange(R, device=paths.device)[:, None]
    real = node_index >= 0
    active = real & (depths < d_max)
    slot = torch.where(real, node_index, scratch)
    has_parent = real & (parent_index >= 0)
    parent_paths = paths[batch, torch.where(has_parent, parent_index, 0)]
    ancestors = torch.where(has_parent[..., None], parent_paths, -1)
    paths[batch, slot] = ancestors.scatter(2, depths.clamp(0, d_max)[..., None],
                                           node_index[..., None])
    node_depth[batch, slot] = torch.where(real, depths, -1)
    return NodePlaces(ancestors, torch.where(active, node_index, scratch),
                      torch.where(active, depths, 0) + 1, torch.where(active, depths, -1),
                      torch.where(real, tokens, 0))


@triton.jit
def _extend_paths_kernel(paths, node_depth, node_index, tokens, parent_index, depths,
                         ancestors_out, kv_slot_out, positions_out, pool_row_out, token_row_out,
                         W, SLOTS, S, BLOCK_S: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    r = row // W
    node = tl.load(node_index + row)
    parent = tl.load(parent_index + row)
    depth = tl.load(depths + row)
    real = node >= 0
    active = real & (depth < S - 1)
    offs = tl.arange(0, BLOCK_S)
    inside = offs < S
    # Masks as block comparisons: the interpreter rejects block & scalar-bool masks.
    zero = tl.zeros((BLOCK_S,), dtype=tl.int64)
    parent_row = paths + (r * SLOTS + tl.maximum(parent, 0)) * S
    has_parent = inside & (zero + node >= 0) & (zero + parent >= 0)
    ancestors = tl.load(parent_row + offs, mask=has_parent, other=-1)
    tl.store(ancestors_out + row * S + offs, ancestors, mask=inside)
    # Padding rows write nothing: their scratch row is never read.
    own = tl.where(offs == tl.minimum(tl.maximum(depth, 0), S - 1), node, ancestors)
    tl.store(paths + (r * SLOTS + node) * S + offs, own, mask=inside & (zero + node >= 0))
    tl.store(node_depth + r * SLOTS + node, depth, mask=real)
    tl.store(kv_slot_out + row, tl.where(active, node, SLOTS - 1))
    tl.store(positions_out + row, tl.where(active, depth, 0) + 1)
    tl.store(pool_row_out + row, tl.where(active, depth, -1))
    tl.store(token_row_out + row, tl.where(real, tl.load(tokens + row), 0))
