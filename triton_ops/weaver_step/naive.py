"""Float64 references of the node-step ops: short, slow and obviously correct."""

from __future__ import annotations

import torch


def naive_rms_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                   eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight + bias over the last dimension, float64."""
    xd = x.double()
    return xd / torch.sqrt((xd * xd).mean(-1, keepdim=True) + eps) * weight.double() + bias.double()


def naive_node_attention(q, k, v, prefix_keys, prefix_values, node_keys, node_values,
                         ancestor_slots, positions=None, rotary=None) -> torch.Tensor:
    """Node by node in float64: softmax over [prefix, ancestors, the node itself].

    Shapes as in :func:`triton_ops.weaver_step.node_attention`; ``node_keys`` /
    values are the cache BEFORE the call (ancestors only). The rotated q and k
    are rounded to the input dtype first, as the model stores and reads them.
    """
    R, w, H, hd = q.shape
    out = torch.zeros(R, w, H, hd, dtype=torch.float64)
    for r in range(R):
        for j in range(w):
            qj, kj = q[r, j].double(), k[r, j].double()
            if rotary is not None:
                cos, sin = (table[positions[r, j]] for table in rotary)
                c, s = torch.cat([cos, cos]).double(), torch.cat([sin, sin]).double()
                half = hd // 2
                qj = qj * c + torch.cat([-qj[:, half:], qj[:, :half]], -1) * s
                kj = kj * c + torch.cat([-kj[:, half:], kj[:, :half]], -1) * s
                qj, kj = qj.to(q.dtype).double(), kj.to(k.dtype).double()
            slots = [int(s) for s in ancestor_slots[r, j] if s >= 0]
            keys = torch.cat([prefix_keys[r].double(), node_keys[r, slots].double(), kj[None]])
            vals = torch.cat([prefix_values[r].double(), node_values[r, slots].double(),
                              v[r, j].double()[None]])
            scores = torch.einsum("hd,thd->ht", qj, keys) / hd**0.5
            out[r, j] = torch.einsum("ht,thd->hd", torch.softmax(scores, -1), vals)
    return out
