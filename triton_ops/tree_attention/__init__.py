"""Ancestor-masked attention of draft-tree nodes over a paged KV cache, and the
commit that moves the accepted path's K/V into place."""

from triton_ops.tree_attention.attention import paged_tree_attention
from triton_ops.tree_attention.kv_commit import tree_kv_commit
from triton_ops.tree_attention.naive import naive_tree_attention, naive_tree_kv_commit

__all__ = ["naive_tree_attention", "naive_tree_kv_commit", "paged_tree_attention", "tree_kv_commit"]
