"""Gated DeltaNet over draft trees: node gates, ancestor-masked chunk verify, path commit,
references."""

from triton_ops.gdn_tree.chunk import (
    Allocate,
    GDNTreeVerifyOutput,
    gdn_tree_commit,
    gdn_tree_commit_layers,
    gdn_tree_verify,
)
from triton_ops.gdn_tree.fused_recurrent import fused_recurrent_gdn_tree
from triton_ops.gdn_tree.gating import gdn_gating
from triton_ops.gdn_tree.naive import naive_recurrent_gdn_tree

__all__ = [
    "Allocate",
    "GDNTreeVerifyOutput",
    "gdn_tree_commit",
    "gdn_tree_commit_layers",
    "gdn_tree_verify",
    "fused_recurrent_gdn_tree",
    "gdn_gating",
    "naive_recurrent_gdn_tree",
]
