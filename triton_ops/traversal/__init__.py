"""The sampled verifiers' per-node sweeps: traversal's sibling loops and subtree
acceptance (:func:`traversal_law`), the descent that samples a verifier's per-node
choices (:func:`walk_choices`)."""

from triton_ops.traversal.traversal import TraversalLaw, traversal_law, walk_choices
from triton_ops.traversal.traversal_torch import sample_index

__all__ = ["TraversalLaw", "sample_index", "traversal_law", "walk_choices"]
