"""Float64 reference for the pool log-softmax: short, slow and obviously correct."""

from __future__ import annotations

import torch


def naive_pool_logits_log_softmax(
    y: torch.Tensor,
    table: torch.Tensor,
    ids: torch.Tensor,
    scores: torch.Tensor,
) -> torch.Tensor:
    """log_softmax over the pool of ``scores + <table[ids], y>``, in float64.

    Args:
        y: [R, w, D] queries.
        table: [V, D] rows gathered by ``ids``.
        ids: [R, w, P] int64 row indices into ``table``.
        scores: [R, w, P] base logits.

    Returns:
        [R, w, P] float64 log-probabilities over the P pool entries of each row.
    """
    rows = table.double()[ids]  # [R, w, P, D]
    logits = scores.double() + (rows * y.double().unsqueeze(2)).sum(-1)
    return logits - torch.logsumexp(logits, dim=-1, keepdim=True)
