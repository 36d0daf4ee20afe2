"""Slow, obviously-correct tree causal conv in float64: the tests' reference.

Each node's input sequence is rebuilt by walking parent pointers (it does not
read ``meta.conv_sources``), so it checks the metadata as well as the kernels.
"""

from __future__ import annotations

import torch

from triton_ops.tree_metadata import TreeMetadata, root_to_node_path


def _node_sequence(
    x: torch.Tensor, conv_state: torch.Tensor, slot: int, parents: list[int], b: int, node: int
) -> list[torch.Tensor]:
    """Inputs seen by ``node`` oldest to newest: committed columns, then its path. [C] each."""
    width_minus_1 = conv_state.shape[2]
    committed = [conv_state[slot, :, col].double() for col in range(width_minus_1)]
    return committed + [x[b, j].double() for j in root_to_node_path(parents, node)]


def naive_tree_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    state_slots: torch.Tensor,
    meta: TreeMetadata,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Per-node conv along parent pointers. Shapes as in :func:`tree_conv1d`.

    Uses only ``meta.parents`` and ``meta.num_nodes``. Returns [B, N, C]
    float64, zeros at padded nodes.
    """
    B, N, C = x.shape
    W = weight.shape[1]
    y = torch.zeros(B, N, C, dtype=torch.float64)
    for b in range(B):
        parents = meta.parents[b].tolist()
        slot = int(state_slots[b])
        for i in range(int(meta.num_nodes[b])):
            seq = _node_sequence(x, conv_state, slot, parents, b, i)
            out = sum(seq[-1 - t] * weight[:, W - 1 - t].double() for t in range(W))
            if bias is not None:
                out = out + bias.double()
            if activation == "silu":
                out = out * torch.sigmoid(out)
            y[b, i] = out
    return y


def naive_tree_conv1d_commit(
    conv_state: torch.Tensor,
    state_slots: torch.Tensor,
    x: torch.Tensor,
    meta: TreeMetadata,
    accepted_leaf: torch.Tensor,
) -> torch.Tensor:
    """The committed conv state, out of place: a copy of ``conv_state`` where the
    slot of every request with ``accepted_leaf >= 0`` holds the last W-1 inputs
    of [old state ; x along the root-to-leaf path], in ``conv_state``'s dtype.
    """
    new_state = conv_state.clone()
    width_minus_1 = conv_state.shape[2]
    for b in range(x.shape[0]):
        leaf = int(accepted_leaf[b])
        if leaf < 0:
            continue
        slot = int(state_slots[b])
        seq = _node_sequence(x, conv_state, slot, meta.parents[b].tolist(), b, leaf)
        for col in range(width_minus_1):
            new_state[slot, :, col] = seq[len(seq) - width_minus_1 + col].to(conv_state.dtype)
    return new_state
