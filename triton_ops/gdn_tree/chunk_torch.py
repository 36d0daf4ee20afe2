"""Batched PyTorch form of tree verify and commit (the CPU path).

All requests and heads go through a handful of batched matmuls and one batched
triangular solve: no per-node Python loop. Arguments are validated by
:mod:`.chunk`; shapes are documented there.
"""

from __future__ import annotations

import torch

from triton_ops.gdn_tree.chunk import GDNTreeVerifyOutput
from triton_ops.gdn_tree.naive import l2_normalize
from triton_ops.tree_metadata import TreeMetadata


def _heads_first(x: torch.Tensor, H: int) -> torch.Tensor:
    """[B, N, HV, ...] -> [B, H, HV // H, N, ...]: value heads grouped under their key head."""
    B, N, HV = x.shape[:3]
    return x.movedim(1, 2).reshape(B, H, HV // H, N, *x.shape[3:])


def verify_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_state: torch.Tensor,
    state_slots: torch.Tensor,
    meta: TreeMetadata,
    scale: float,
    use_qk_l2norm: bool,
) -> GDNTreeVerifyOutput:
    B, N, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    out_dtype = v.dtype
    valid = meta.valid
    # Padding rows may hold anything (NaN included): zero them before any product.
    row = valid[:, :, None, None]
    q, k, v = (torch.where(row, x.to(dt), 0.0) for x in (q, k, v))
    g, beta = (torch.where(valid[..., None], x.to(dt), 0.0) for x in (g, beta))
    if use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)

    gate_sum = meta.ancestors.double() @ g.double()  # [B, N, HV]: G = Mbar g
    qh = (q * scale).transpose(1, 2).unsqueeze(2)  # [B, H, 1, N, K]
    kh = k.transpose(1, 2).unsqueeze(2)
    vh = _heads_first(v, H)  # [B, H, G, N, V]
    gh = _heads_first(gate_sum, H)  # [B, H, G, N]
    bh = _heads_first(beta, H)

    ancestors = meta.ancestors[:, None, None]  # [B, 1, 1, N, N], Mbar
    diff = (gh[..., :, None] - gh[..., None, :]).to(dt)
    decay = torch.exp(torch.where(ancestors, diff, float("-inf")))
    # Lower triangle incl. the diagonal; the unit-triangular solve never reads the diagonal.
    a = bh[..., None] * (kh @ kh.transpose(-1, -2)) * decay
    s0 = ssm_state[state_slots.long()].to(dt).view(B, H, HV // H, K, V)
    eg = gh.to(dt).exp()[..., None]
    rhs = bh[..., None] * (vh - eg * (kh @ s0))
    delta = torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True)
    o = eg * (qh @ s0) + ((qh @ kh.transpose(-1, -2)) * decay) @ delta

    def nodes_first(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(B, HV, N, V).transpose(1, 2).contiguous()

    return GDNTreeVerifyOutput(
        o=nodes_first(o).to(out_dtype),
        delta=nodes_first(delta),
        gate_sum=gate_sum.contiguous(),
        k_normed=k.contiguous(),
    )


def commit_torch(
    ssm_state: torch.Tensor,
    state_slots: torch.Tensor,
    meta: TreeMetadata,
    out: GDNTreeVerifyOutput,
    accepted_leaf: torch.Tensor,
) -> None:
    rows = (accepted_leaf >= 0).nonzero().squeeze(1)
    if rows.numel() == 0:
        return
    R = rows.numel()
    _, N, HV, V = out.delta.shape
    H, K = out.k_normed.shape[2], out.k_normed.shape[3]
    leaf = accepted_leaf.long()[rows]
    path = meta.path_mask(accepted_leaf)[rows]  # [R, N]
    gate_sum = out.gate_sum[rows]  # [R, N, HV]
    g_leaf = gate_sum[torch.arange(R, device=rows.device), leaf]  # [R, HV]
    dt = out.delta.dtype
    diff = (g_leaf[:, None] - gate_sum).to(dt)
    weight = torch.exp(torch.where(path[..., None], diff, float("-inf")))  # exp(G_l - G_j) on the path
    weighted = (weight[..., None] * out.delta[rows]).view(R, N, H, HV // H, V)
    update = torch.einsum("rnhk,rnhgv->rhgkv", out.k_normed[rows], weighted).reshape(R, HV, K, V)
    slots = state_slots.long()[rows]
    s0 = ssm_state[slots].to(dt)
    ssm_state[slots] = (g_leaf.to(dt).exp()[..., None, None] * s0 + update).to(ssm_state.dtype)
