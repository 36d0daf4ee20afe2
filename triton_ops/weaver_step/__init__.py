"""The Weaver node step and the best-first frontier: fused kernels and their references.

``rms_norm`` (RMSNorm with weight and bias; ``add_rms_norm`` adds a residual first),
``silu_mul`` (SwiGLU's gate), ``extend_paths`` (the nodes' ancestors,
cache slots and positions), ``node_attention`` (w new tree nodes attend to the
prefix, their ancestors and themselves; rotary and the node's K/V write folded
in), and the frontier's ``pop_frontier`` / ``push_children`` (ties as a stable
descending sort breaks them). Each torch path is the reference; ``naive`` holds
float64 forms of the numeric ops.
"""

from triton_ops.weaver_step.activation import silu_mul
from triton_ops.weaver_step.attention import apply_rotary, node_attention
from triton_ops.weaver_step.frontier import (
    ExpandBatch,
    Frontier,
    GrowingTree,
    pop_frontier,
    push_children,
)
from triton_ops.weaver_step.naive import naive_node_attention, naive_rms_norm
from triton_ops.weaver_step.node_paths import NodePlaces, extend_paths
from triton_ops.weaver_step.norm import add_rms_norm, rms_norm

__all__ = [
    "ExpandBatch",
    "Frontier",
    "GrowingTree",
    "NodePlaces",
    "add_rms_norm",
    "apply_rotary",
    "extend_paths",
    "naive_node_attention",
    "naive_rms_norm",
    "node_attention",
    "pop_frontier",
    "push_children",
    "rms_norm",
    "silu_mul",
]
