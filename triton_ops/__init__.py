"""Triton kernels for tree speculative decoding, each beside a PyTorch reference."""

from triton_ops.tree_metadata import TreeMetadata, build_tree_metadata

__all__ = ["TreeMetadata", "build_tree_metadata"]
