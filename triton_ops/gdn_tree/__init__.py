"""Gated DeltaNet over draft trees: ancestor-masked chunk verify, path commit, references."""

from triton_ops.gdn_tree.chunk import (
    GDNTreeVerifyOutput,
    gdn_tree_commit,
    gdn_tree_verify,
)
from triton_ops.gdn_tree.fused_recurrent import fused_recurrent_gdn_tree
from triton_ops.gdn_tree.naive import naive_recurrent_gdn_tree

__all__ = [
    "GDNTreeVerifyOutput",
    "gdn_tree_commit",
    "gdn_tree_verify",
    "fused_recurrent_gdn_tree",
    "naive_recurrent_gdn_tree",
]
