"""Traversal verification's per-node sweeps: the sibling loops and subtree acceptance
(:func:`traversal_law`), the descent that samples them (:func:`walk_choices`)."""

from triton_ops.traversal.traversal import TraversalLaw, traversal_law, walk_choices
from triton_ops.traversal.traversal_torch import sample_index

__all__ = ["TraversalLaw", "sample_index", "traversal_law", "walk_choices"]
