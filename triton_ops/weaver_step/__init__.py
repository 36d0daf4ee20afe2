"""The Weaver node step and the best-first frontier: fused kernels and their references.

``rms_norm`` (RMSNorm with weight and bias), ``node_attention`` (w new tree nodes
attend to the prefix, their ancestors and themselves; rotary and the node's K/V
write folded in) and ``take_top`` (the top entries of each row, ties to the
lowest column: the frontier pop and a node's children).
"""

from triton_ops.weaver_step.naive import naive_node_attention, naive_rms_norm, naive_take_top
from triton_ops.weaver_step.node_attention import apply_rotary, node_attention
from triton_ops.weaver_step.rms_norm import rms_norm
from triton_ops.weaver_step.take_top import take_top

__all__ = [
    "apply_rotary",
    "naive_node_attention",
    "naive_rms_norm",
    "naive_take_top",
    "node_attention",
    "rms_norm",
    "take_top",
]
