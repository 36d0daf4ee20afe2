"""Triton kernels for tree speculative decoding, each beside a PyTorch reference.

One subpackage per op (``gdn_tree``, ``tree_conv``, ``tree_attention``,
``pool_logits``, ``weaver_step``: the Weaver node step and the best-first
frontier, ``traversal``: the sampled verifiers' per-node sweeps), each with
its reference; ``tree_metadata`` holds
the step's topology that all of them read, ``utils`` the backend choice,
checks and jit helpers they share, ``testing`` the random trees of the tests
and benchmarks. The names below bind no submodule's name, so every
``import triton_ops.<op>.<module>`` still works after ``import triton_ops``.
"""

from triton_ops.gdn_tree import GDNTreeVerifyOutput, gdn_tree_commit, gdn_tree_verify
from triton_ops.pool_logits import pool_logits_log_softmax
from triton_ops.tree_attention import paged_tree_attention, tree_kv_commit
from triton_ops.tree_conv import tree_conv1d, tree_conv1d_commit
from triton_ops.tree_metadata import TreeMetadata, build_tree_metadata

__all__ = [
    "GDNTreeVerifyOutput",
    "TreeMetadata",
    "build_tree_metadata",
    "gdn_tree_commit",
    "gdn_tree_verify",
    "paged_tree_attention",
    "pool_logits_log_softmax",
    "tree_conv1d",
    "tree_conv1d_commit",
    "tree_kv_commit",
]
