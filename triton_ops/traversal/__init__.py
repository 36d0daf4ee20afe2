"""The verifiers' per-node sweeps: traversal's sibling loops and subtree acceptance
(:func:`traversal_law`), the descent that samples a verifier's per-node choices
(:func:`walk_choices`), greedy's descent (:func:`greedy_walk`)."""

from triton_ops.traversal.traversal import (
    TraversalLaw,
    greedy_walk,
    traversal_law,
    walk_choices,
)
from triton_ops.traversal.traversal_torch import sample_index

__all__ = ["TraversalLaw", "greedy_walk", "sample_index", "traversal_law", "walk_choices"]
