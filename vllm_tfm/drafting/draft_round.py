"""One draft round: DFlash marginals -> top-K candidate pools -> a draft tree per request.

The engine's proposer (``vllm_tfm/vllm_glue/proposer.py``) and the training and
evaluation tools (``vllm_tfm/training/acceptance.py``, ``tools/bench_drafting.py``)
draft through these functions, so for the same DFlash states they grow the same
trees. What differs between them stays with them: how the drafter runs and how
its states reach the target's LM head (vLLM's ``compute_logits`` or a plain
matmul).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from vllm_tfm.drafting.builders import build_chain, build_ddtree, build_weaver_tree
from vllm_tfm.drafting.tree import DraftTree
from vllm_tfm.options import DEFAULT_FANOUT, TREE_KINDS

if TYPE_CHECKING:
    from vllm_tfm.drafting.weaver import Weaver


class CandidatePools(NamedTuple):
    """Top-P candidates of each draft position: row d holds those of depth d + 1.

    ids: [R, D, P] int64 token ids (distinct per row).
    scores: [R, D, P] float32 raw target-LM-head logits, descending along P.
    (Training batches may carry more leading dimensions than R.)
    """

    ids: torch.Tensor
    scores: torch.Tensor


def candidate_pools(logits: torch.Tensor, pool_size: int) -> CandidatePools:
    """The top-``min(pool_size, V)`` raw logits of each draft position.

    ``logits``: [R, D, V] target-LM-head logits of the DFlash states at block
    positions 1..D (any float dtype; ranked in float32; any leading dimensions).
    """
    scores, ids = torch.topk(logits.float(), min(pool_size, logits.shape[-1]), dim=-1)
    return CandidatePools(ids, scores)


def draft_depth(budget: int, dflash_depth: int, weaver: Weaver | None = None) -> int:
    """Draft positions D of a round: the DFlash block's masks, cut to the budget (a tree
    of ``budget`` nodes is at most that deep) and to the Weaver's maximum depth K."""
    depth = min(dflash_depth, budget)
    return depth if weaver is None else min(depth, weaver.config.K)


def draft_trees(
    tree: str,
    root_tokens: torch.Tensor,
    pools: CandidatePools,
    budget: int,
    *,
    weaver: Weaver | None = None,
    h_v: torch.Tensor | None = None,
    dflash_hidden: torch.Tensor | None = None,
    fanout: int = DEFAULT_FANOUT,
    expand_width: int | None = None,
    validate: bool = True,
    backend: str = "auto",
) -> DraftTree:
    """The draft trees of one round for R requests.

    Args:
        tree: "weaver" (Weaver's best-first tree), "ddtree" (the ``budget`` most
            likely prefixes under the marginals) or "chain" (the argmax path).
        root_tokens: [R] int64, the previous step's bonus tokens.
        pools: the round's :class:`CandidatePools`, D = ``pools.ids.shape[1]``.
        budget: nodes per tree after the root.
        weaver, h_v, dflash_hidden: tree "weaver" only: the Weaver (tables
            prepared), the target's final-norm state at the last committed
            position [R, d_model] and the DFlash states at block positions 1..D
            [R, D, d_model]; cast to the Weaver's dtype and device here.
        fanout, expand_width: tree "weaver" only (see ``build_weaver_tree``);
            ``expand_width`` None is ``options.default_expand_width(budget)``.
        validate: check the inputs on the host. The engine turns it off: its
            pools come from top-k and its nodes from the builders.
        backend: tree "weaver" only: the frontier ops' backend (see
            ``build_weaver_tree``).
    """
    ids, scores = pools
    if tree == "chain":
        return build_chain(root_tokens, ids, scores, budget, validate=validate)
    if tree == "ddtree":
        return build_ddtree(root_tokens, ids, scores, budget, validate=validate)
    if tree != "weaver":
        raise ValueError(f"tree must be one of {list(TREE_KINDS)}, got {tree!r}")
    if weaver is None or h_v is None or dflash_hidden is None:
        raise ValueError("tree 'weaver' needs weaver, h_v and dflash_hidden")
    session = weaver.start_round(
        h_v.to(weaver.device, weaver.dtype),
        dflash_hidden.to(weaver.device, weaver.dtype),
        ids,
        scores,
        max_nodes=budget + 1,
        validate=validate,
    )
    return build_weaver_tree(
        root_tokens, ids, session, budget, fanout=fanout, expand_width=expand_width,
        validate=validate, backend=backend,
    )
