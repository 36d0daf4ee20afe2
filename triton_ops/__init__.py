"""Triton kernels for tree speculative decoding, each beside a PyTorch reference."""

from triton_ops.tree_metadata import TreeMetadata, build_tree_metadata
from triton_ops.tree_conv import tree_conv1d, tree_conv1d_commit

__all__ = ["TreeMetadata", "build_tree_metadata"]
__all__ += ["tree_conv1d", "tree_conv1d_commit"]
from triton_ops.pool_logits import naive_pool_logits_log_softmax, pool_logits_log_softmax  # noqa: E402
__all__ += ["naive_pool_logits_log_softmax", "pool_logits_log_softmax"]
from triton_ops.gdn_tree import GDNTreeVerifyOutput, gdn_tree_commit, gdn_tree_verify, naive_recurrent_gdn_tree  # noqa: E402
__all__ += ["GDNTreeVerifyOutput", "gdn_tree_commit", "gdn_tree_verify", "naive_recurrent_gdn_tree"]
from triton_ops.tree_attention import tree_attention, tree_kv_commit  # noqa: E402
__all__ += ["tree_attention", "tree_kv_commit"]
