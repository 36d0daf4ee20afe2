"""Tree-aware causal conv1d over draft trees, its commit and the naive reference."""

from triton_ops.tree_conv.conv import (
    tree_conv1d,
    tree_conv1d_commit,
    tree_conv1d_commit_layers,
)
from triton_ops.tree_conv.naive import naive_tree_conv1d, naive_tree_conv1d_commit

__all__ = [
    "naive_tree_conv1d",
    "naive_tree_conv1d_commit",
    "tree_conv1d",
    "tree_conv1d_commit",
    "tree_conv1d_commit_layers",
]
