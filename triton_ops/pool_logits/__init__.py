"""Pool log-softmax: scores + gathered low-rank residual logits, normalised over the pool."""

from triton_ops.pool_logits.naive import naive_pool_logits_log_softmax
from triton_ops.pool_logits.pool_logits import pool_logits_log_softmax

__all__ = ["naive_pool_logits_log_softmax", "pool_logits_log_softmax"]
