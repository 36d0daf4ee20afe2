"""Per-node-state recurrence over a tree: what serving engines do today.

Every node writes its full state ``S_i`` [K, V] to memory and every child
reloads its parent's, so the cost grows with N * K * V bytes per head. Kept as
the baseline that the chunk form (:mod:`.chunk`) is measured against.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton_ops.gdn_tree.chunk import DEFAULT_PRECISION, _check_verify_inputs
from triton_ops.gdn_tree.chunk_triton import l2_normalize_rows
from triton_ops.tree_metadata import TreeMetadata
from triton_ops.utils import dot_block, use_triton


@triton.jit
def _recurrent_kernel(
    q, k, v, g, beta, state, slots, parents, num_nodes, o, node_states,
    stride_qb, stride_qn, stride_qh, stride_qk,
    stride_kb, stride_kn, stride_kh, stride_kk,
    stride_vb, stride_vn, stride_vh, stride_vv,
    stride_gb, stride_gn, stride_gh,
    stride_bb, stride_bn, stride_bh,
    stride_ss, stride_sh, stride_sk, stride_sv,
    scale, N, HV, K, V,
    GROUP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, USE_L2: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1)
    b = (i_bh // HV).to(tl.int64)
    hv = i_bh % HV
    h = hv // GROUP
    n_b = tl.load(num_nodes + b)
    ck = tl.arange(0, BK)
    cv = i_v * BV + tl.arange(0, BV)
    mk = ck < K
    mv = cv < V
    mkv = mk[:, None] & mv[None, :]
    slot = tl.load(slots + b).to(tl.int64)
    s0_ptr = state + slot * stride_ss + hv * stride_sh + ck[:, None] * stride_sk + cv[None, :] * stride_sv
    tile = ck[:, None] * V + cv[None, :]
    for i in range(0, n_b):
        parent = tl.load(parents + b * N + i)
        # Exactly one of the two loads is live: K rows of S0 for a root, else the parent's.
        s0_rows = tl.where(parent < 0, K, 0)
        from_s0 = tl.load(s0_ptr, mask=(ck[:, None] < s0_rows) & mv[None, :], other=0.0)
        parent_ptr = node_states + ((b * N + tl.maximum(parent, 0)) * HV + hv) * K * V + tile
        parent_rows = K - s0_rows
        b_s = from_s0.to(tl.float32) + tl.load(
            parent_ptr, mask=(ck[:, None] < parent_rows) & mv[None, :], other=0.0
        )
        b_q = tl.load(q + b * stride_qb + i * stride_qn + h * stride_qh + ck * stride_qk, mask=mk, other=0.0)
        b_k = tl.load(k + b * stride_kb + i * stride_kn + h * stride_kh + ck * stride_kk, mask=mk, other=0.0)
        b_q = l2_normalize_rows(b_q.to(tl.float32)[None, :], USE_L2) * scale
        b_k = l2_normalize_rows(b_k.to(tl.float32)[None, :], USE_L2)
        b_v = tl.load(v + b * stride_vb + i * stride_vn + hv * stride_vh + cv * stride_vv, mask=mv, other=0.0)
        b_g = tl.load(g + b * stride_gb + i * stride_gn + hv * stride_gh).to(tl.float32)
        b_beta = tl.load(beta + b * stride_bb + i * stride_bn + hv * stride_bh).to(tl.float32)
        b_s *= tl.exp(b_g)
        u = b_beta * (b_v.to(tl.float32) - tl.sum(b_s * tl.trans(b_k), axis=0))
        b_s += tl.trans(b_k) * u[None, :]
        b_o = tl.sum(b_s * tl.trans(b_q), axis=0)
        tl.store(node_states + ((b * N + i) * HV + hv) * K * V + tile, b_s, mask=mkv)
        tl.store(o + ((b * N + i) * HV + hv) * V + cv, b_o.to(o.dtype.element_ty), mask=mv)
        # Children read this state back: order the store before their loads.
        tl.debug_barrier()
    for i in range(n_b, N):
        tl.store(o + ((b * N + i) * HV + hv) * V + cv, tl.zeros([BV], dtype=tl.float32).to(o.dtype.element_ty), mask=mv)


def fused_recurrent_gdn_tree(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_state: torch.Tensor,
    state_slots: torch.Tensor,
    meta: TreeMetadata,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    node_states: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the recurrence node by node, storing every node's state.

    Args: as :func:`triton_ops.gdn_tree.gdn_tree_verify` (CUDA tensors, or CPU
        tensors under ``TRITON_INTERPRET=1``), plus
        node_states: optional [B, N, HV, K, V] fp32 contiguous buffer to write into.

    Returns:
        o: [B, N, HV, V] in v's dtype, zeros at padding nodes.
        node_states: [B, N, HV, K, V] fp32, node ``i``'s state; padding rows
            are left as they were.
    """
    # Kernel only: use_triton raises the shared error where no kernel can run.
    _check_verify_inputs(q, k, v, g, beta, ssm_state, state_slots, meta,
                         use_triton("triton", q), DEFAULT_PRECISION)
    B, N, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if node_states is None:
        node_states = torch.empty(B, N, HV, K, V, dtype=torch.float32, device=q.device)
    if node_states.shape != (B, N, HV, K, V) or not node_states.is_contiguous() or (
        node_states.dtype != torch.float32
    ):
        raise ValueError(
            f"node_states must be a contiguous fp32 [{B}, {N}, {HV}, {K}, {V}] tensor, "
            f"got {node_states.dtype} {list(node_states.shape)}"
        )
    scale = K**-0.5 if scale is None else float(scale)
    BK = dot_block(K)
    BV = max(16, min(triton.next_power_of_2(V), 8192 // BK, 64))
    o = torch.empty(B, N, HV, V, dtype=v.dtype, device=q.device)
    _recurrent_kernel[(triton.cdiv(V, BV), B * HV)](
        q, k, v, g, beta, ssm_state, state_slots, meta.parents, meta.num_nodes, o, node_states,
        *q.stride(), *k.stride(), *v.stride(), *g.stride(), *beta.stride(), *ssm_state.stride(),
        scale, N, HV, K, V,
        GROUP=HV // H, BK=BK, BV=BV, USE_L2=use_qk_l2norm, num_warps=4,
    )
    return o, node_states
