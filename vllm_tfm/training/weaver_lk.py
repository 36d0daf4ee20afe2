"""Weaver training: candidate pools, teacher forcing with gradients, the LK loss.

Teacher forcing. For a block at anchor p of a target-generated sequence x, the nodes of
the ground-truth path are x_p (root, depth 0), x_{p+1} (depth 1), ..., x_{p+D-1}; node j
scores pool row j (the candidates for x_{p+j+1}). A node attends to the D+1 prefix
entries, its ancestors and itself, so the prefix followed by the path's nodes is ONE
causal sequence of 2D+1 entries (positions 0..D, then 1..D): the whole path trains in
one pass (`Weaver.causal_pass` with the path appended). The inference path
(`Weaver.start_round` / `WeaverRound.expand`) runs under no_grad and reads cached
vocabulary tables; here the same quantities are recomputed from the parameters:
token_in(embed_norm(E[token])) for a node's input, and
<W_lm[c], lm_head_query_in(y)> (= <(W_lm @ lm_head_query_in.weight)[c], y>) for the
residual logits, so gradients reach token_in, embed_norm and lm_head_query_in.

The LK loss (DESIGN.md section 3) compares the target's next-token distribution p at
each node with Weaver's q over the node's pool. p is RESTRICTED TO THE POOL AND
RENORMALISED: q lives on the pool only, so min(p, q) and KL(p || q) are only defined
there; the mass the pool misses is reported (`pool_target`), not trained on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vllm_tfm.drafting.draft_round import CandidatePools, candidate_pools
from vllm_tfm.drafting.weaver import Weaver

LK_ETA = 2.0
GREEDY_WEIGHT = 0.1


def lm_head_pools(dflash_hidden: torch.Tensor, lm_head: torch.Tensor,
                  pool_size: int) -> CandidatePools:
    """The engine's pools (`candidate_pools`) with the target's LM head as a plain matmul.

    Args:
        dflash_hidden: [..., D, d] DFlash final states at block positions 1..D.
        lm_head: [V, d] target LM head.
        pool_size: P requested (min(P, V) is used).
    """
    return candidate_pools(dflash_hidden.to(lm_head.dtype) @ lm_head.T, pool_size)


def teacher_forced_logq(
    weaver: Weaver,
    h_v: torch.Tensor,
    dflash_hidden: torch.Tensor,
    node_tokens: torch.Tensor,
    pool_ids: torch.Tensor,
    pool_scores: torch.Tensor,
    embed: torch.Tensor,
    lm_head: torch.Tensor,
) -> torch.Tensor:
    """log q over each path node's pool, differentiable in Weaver's parameters.

    Args:
        h_v: [M, d_model] target final-norm state at the position before the anchor.
        dflash_hidden: [M, D, d_model] DFlash states at block positions 1..D.
        node_tokens: [M, D] tokens of path nodes at depths 0..D-1 (x_p..x_{p+D-1}).
        pool_ids, pool_scores: [M, D, P] pools (row j = candidates of depth j + 1).
        embed: [V, d_embed] target embedding; lm_head: [V, d_model] target LM head.

    Returns:
        [M, D, P] float32 log q(c | root..node_j) for row j.
    """
    depth = dflash_hidden.shape[1]
    if node_tokens.shape != dflash_hidden.shape[:2] or pool_ids.shape[:2] != node_tokens.shape:
        raise ValueError(
            f"node_tokens {list(node_tokens.shape)} and pool_ids {list(pool_ids.shape)} must "
            f"start with dflash_hidden's [M, D] = {list(dflash_hidden.shape[:2])}"
        )
    dtype = weaver.dtype
    nodes = weaver.token_in(weaver.embed_norm(F.embedding(node_tokens, embed).to(dtype)))
    x = weaver.causal_pass(h_v.to(dtype), dflash_hidden.to(dtype), nodes).hidden
    y = weaver.out_norm(x[:, depth + 1 :])
    query = weaver.lm_head_query_in(y)  # [M, D, d_model]
    # All-vocabulary product, then the pool's columns: [M, D, V] is far smaller than the
    # pool's LM-head rows [M, D, P, d]; in the head's dtype, not an fp32 copy of it.
    residual = (query.to(lm_head.dtype) @ lm_head.T).float().gather(-1, pool_ids)
    return torch.log_softmax(pool_scores.float() + residual, -1)


def pool_target(target_logits: torch.Tensor, pool_ids: torch.Tensor):
    """The target's next-token distribution restricted to the pool.

    Args:
        target_logits: [..., V] target logits (temperature 1).
        pool_ids: [..., P] pool ids.

    Returns:
        p [..., P] float32, renormalised over the pool, and retained [...], the target
        mass inside the pool before renormalising.
    """
    probs = torch.softmax(target_logits.float(), -1)
    kept = probs.gather(-1, pool_ids)
    retained = kept.sum(-1)
    return kept / retained.clamp(min=torch.finfo(kept.dtype).tiny)[..., None], retained


@dataclass
class LKTerms:
    """Per-node terms of the LK loss, [...] each; `loss` is their mean combination."""

    loss: torch.Tensor
    alpha: torch.Tensor
    kl: torch.Tensor
    ce: torch.Tensor


def lk_loss(p: torch.Tensor, logq: torch.Tensor, eta: float = LK_ETA,
            greedy_weight: float = GREEDY_WEIGHT) -> LKTerms:
    """L = lambda KL(p || q) + (1 - lambda)(1 - alpha) + greedy_weight CE(argmax p).

    alpha = sum_v min(p_v, q_v) = 1 - TV(p, q) (the chance one drafted token is
    accepted), lambda = exp(-eta * stopgrad(alpha)): KL pulls while the two are far
    apart, the direct acceptance term takes over as they meet.

    Args:
        p: [..., P] target distribution over the pool (sums to 1).
        logq: [..., P] log q over the same pool entries.
    """
    q = logq.exp()
    alpha = torch.minimum(p, q).sum(-1)
    lam = torch.exp(-eta * alpha.detach())
    kl = (torch.xlogy(p, p) - torch.where(p > 0, p * logq, 0.0)).sum(-1)
    ce = -logq.gather(-1, p.argmax(-1, keepdim=True))[..., 0]
    per_node = lam * kl + (1 - lam) * (1 - alpha) + greedy_weight * ce
    return LKTerms(loss=per_node.mean(), alpha=alpha, kl=kl, ce=ce)
