"""Ground truth: the gated delta rule run node by node along parent pointers, in float64."""

from __future__ import annotations

import torch

from triton_ops.tree_metadata import TreeMetadata


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dimension (fla's convention)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def naive_recurrent_gdn_tree(
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-node recurrence, float64; the reference every fast form is tested against.

    Node ``i`` starts from its parent's state (the committed state ``S0`` for
    roots) and applies one step of the chain rule (fla's convention):

        S_i = e^{g_i} (I - beta_i k_i k_i^T) S_parent + beta_i k_i v_i^T,   o_i = S_i^T (scale q_i)

    Shapes as in :func:`triton_ops.gdn_tree.gdn_tree_verify`.

    Returns:
        o: [B, N, HV, V] float64, zeros at padding nodes.
        states: [B, N, HV, K, V] float64, each node's state ``S_i``, zeros at padding.
    """
    B, N, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    scale = K**-0.5 if scale is None else scale
    f64 = torch.float64
    q, k, v, g, beta = (x.to(f64) for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    group = HV // H
    q = q.repeat_interleave(group, dim=2) * scale
    k = k.repeat_interleave(group, dim=2)
    s0 = ssm_state[state_slots.long()].to(f64)  # [B, HV, K, V]

    states = torch.zeros(B, N, HV, K, V, dtype=f64, device=q.device)
    o = torch.zeros(B, N, HV, V, dtype=f64, device=q.device)
    batch = torch.arange(B, device=q.device)
    for i in range(N):
        parent = meta.parents[:, i].long()
        from_parent = states[batch, parent.clamp(min=0)]
        s = torch.where((parent >= 0).view(B, 1, 1, 1), from_parent, s0)
        s = s * g[:, i].exp()[..., None, None]
        k_i = k[:, i]
        u = beta[:, i, :, None] * (v[:, i] - torch.einsum("bhkv,bhk->bhv", s, k_i))
        s = s + k_i[..., None] * u[..., None, :]
        real = meta.valid[:, i].view(B, 1, 1, 1)
        states[:, i] = torch.where(real, s, 0.0)
        o[:, i] = torch.where(real[..., 0], torch.einsum("bhkv,bhk->bhv", s, q[:, i]), 0.0)
    return o, states
