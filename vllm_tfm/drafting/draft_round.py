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

from vllm_tfm.drafting.builders import (
    ChildConstraint,
    build_chain,
    build_ddtree,
    build_sampled_tree,
    build_weaver_tree,
    sampled_first_exponent,
)
from vllm_tfm.drafting.tree import DraftTree
from vllm_tfm.options import DEFAULT_FANOUT, SAMPLED_TREE_KINDS, TREE_KINDS

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
    positions 1..D (any float dtype; any leading dimensions). Ranked in their own dtype:
    widening to float32 is exact and keeps the order, and a float32 copy of a 248k-token
    vocabulary's logits is 1 MB a position; only the pools are widened.
    """
    scores, ids = torch.topk(logits, min(pool_size, logits.shape[-1]), dim=-1)
    return CandidatePools(ids, scores.float())


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
    sample_seeds: torch.Tensor | None = None,
    constraint: ChildConstraint | None = None,
    fixed_widths: bool = False,
    first_exponent: float | None = None,
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
        sample_seeds: None for deterministic trees; [R] int64 per-request seeds
            for trees whose children are sampled (the input traversal verification
            gains on): tree "weaver" grows best-first and samples from Weaver's q
            (``build_weaver_tree`` with seeds), "ddtree" keeps its shape and samples
            from the marginals (``build_sampled_tree``); "chain" has no sampled form.
        constraint: the tokens each expanded node's children may take (a grammar;
            see ``builders.ChildConstraint``). It reads the host, so a constrained
            round runs eagerly (``DraftRound`` takes none).
        fixed_widths: sampled DDTree trees only: the build that reads nothing back
            from the device (``build_sampled_tree``), the same trees (Weaver's builds
            never read back).
        first_exponent: sampled trees only: the first child slot's score exponent
            (``build_weaver_tree``, ``build_sampled_tree``); None: the kind's own
            (``builders.sampled_first_exponent``).
    """
    ids, scores = pools
    first_exponent = sampled_first_exponent(tree, first_exponent)
    if sample_seeds is not None and tree not in SAMPLED_TREE_KINDS:
        raise ValueError(f"sampled trees exist for tree in {list(SAMPLED_TREE_KINDS)}, "
                         f"got {tree!r}")
    if tree == "chain":
        return build_chain(root_tokens, ids, scores, budget, validate=validate,
                           constraint=constraint)
    if tree == "ddtree" and sample_seeds is not None:
        return build_sampled_tree(root_tokens, ids, scores, budget, sample_seeds,
                                  validate=validate, constraint=constraint,
                                  fixed_widths=fixed_widths, first_exponent=first_exponent)
    if tree == "ddtree":
        return build_ddtree(root_tokens, ids, scores, budget, validate=validate,
                            constraint=constraint)
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
        validate=validate, backend=backend, constraint=constraint, seeds=sample_seeds,
        first_exponent=first_exponent,
    )


class _RowsOf:
    """A batch's constraint seen by a builder that grows only rows ``rows`` of it."""

    def __init__(self, constraint: ChildConstraint, rows: torch.Tensor, total: int):
        self.constraint, self.rows, self.total = constraint, rows, total

    def child_bitmask(self, tokens, parents, nodes):
        def whole(part: torch.Tensor, fill: int) -> torch.Tensor:
            full = part.new_full((self.total, part.shape[1]), fill)
            full[self.rows.to(part.device)] = part
            return full

        masks = self.constraint.child_bitmask(whole(tokens, 0), whole(parents, -1),
                                              whole(nodes, -1))
        return masks[self.rows.to(masks.device)]



def draft_trees_per_request(
    tree: str,
    root_tokens: torch.Tensor,
    pools: CandidatePools,
    budget: int,
    sampled: list[bool],
    seeds: torch.Tensor | None,
    *,
    weaver: Weaver | None = None,
    h_v: torch.Tensor | None = None,
    dflash_hidden: torch.Tensor | None = None,
    constraint: ChildConstraint | None = None,
    **options,
) -> DraftTree:
    """Trees for a batch that mixes requests: row r is a sampled tree (seed
    ``seeds[r]``) where ``sampled[r]``, else the deterministic tree, each as
    :func:`draft_trees` builds it on its own rows.

    A batch with no sampled row is exactly :func:`draft_trees`' deterministic
    batch. In a mixed batch the result carries the pools and proposals of a
    sampled tree for every row; the deterministic rows' proposals are -inf
    everywhere, so only verifiers that ignore them (greedy, target-only) may
    read those rows. ``options``: the other arguments of :func:`draft_trees`.
    """
    if len(sampled) != root_tokens.shape[0]:
        raise ValueError(f"sampled must hold one flag per request ({root_tokens.shape[0]}), "
                         f"got {len(sampled)}")
    if not any(sampled):
        return draft_trees(tree, root_tokens, pools, budget, weaver=weaver, h_v=h_v,
                           dflash_hidden=dflash_hidden, constraint=constraint, **options)
    if seeds is None:
        raise ValueError("sampled trees need seeds")
    device = root_tokens.device
    flags = torch.tensor(sampled, device=device)
    parts = []
    for want in (False, True):
        rows = (flags == want).nonzero()[:, 0]
        if rows.numel() == 0:
            continue
        pick = lambda t: None if t is None else t.index_select(0, rows.to(t.device))  # noqa: E731
        part = draft_trees(
            tree, root_tokens[rows], CandidatePools(pick(pools.ids), pick(pools.scores)),
            budget, weaver=weaver, h_v=pick(h_v), dflash_hidden=pick(dflash_hidden),
            sample_seeds=seeds[rows] if want else None,
            constraint=None if constraint is None else _RowsOf(constraint, rows,
                                                               root_tokens.shape[0]),
            **options,
        )
        parts.append((rows, part))
    if len(parts) == 1:
        return parts[0][1]
    (plain_rows, plain), (sampled_rows, drawn) = parts
    if plain.tokens.shape[1] != drawn.tokens.shape[1] or plain.max_depth != drawn.max_depth:
        raise ValueError(f"deterministic and sampled trees differ in shape: "
                         f"{list(plain.tokens.shape)} depth {plain.max_depth} vs "
                         f"{list(drawn.tokens.shape)} depth {drawn.max_depth}")
    plain_pools = pools.ids.index_select(0, plain_rows)
    joined = DraftTree(
        tokens=torch.cat([plain.tokens, drawn.tokens]),
        parents=torch.cat([plain.parents, drawn.parents]),
        depths=torch.cat([plain.depths, drawn.depths]),
        num_nodes=torch.cat([plain.num_nodes, drawn.num_nodes]),
        draft_logq=torch.cat([plain.draft_logq, drawn.draft_logq]),
        max_depth=drawn.max_depth,
        pool_ids=torch.cat([plain_pools, drawn.pool_ids]),
        proposal_logq=torch.cat([torch.full_like(drawn.proposal_logq[:1], float("-inf"))
                                 .expand(plain_rows.numel(), -1, -1), drawn.proposal_logq]),
    )
    return joined.select(torch.argsort(torch.cat([plain_rows, sampled_rows])))


def draft_trees_by_mask(
    tree: str,
    root_tokens: torch.Tensor,
    pools: CandidatePools,
    budget: int,
    sampled: torch.Tensor,
    seeds: torch.Tensor,
    **options,
) -> DraftTree:
    """Row r: the sampled tree (seed ``seeds[r]``) where ``sampled[r]`` ([R] bool on the
    device), else the deterministic tree. Both are grown for every row and chosen row by
    row on the device, so nothing is read back and a CUDA graph can hold the round.

    Every row carries pools and proposals; a deterministic row's proposals are -inf (only
    verifiers that ignore them may read it, as in :func:`draft_trees_per_request`).
    ``options``: the other arguments of :func:`draft_trees` but ``constraint`` (which reads
    the host).
    """
    plain = draft_trees(tree, root_tokens, pools, budget, **options)
    drawn = draft_trees(tree, root_tokens, pools, budget, sample_seeds=seeds,
                        fixed_widths=True, **options)
    if plain.max_nodes != drawn.max_nodes:
        raise ValueError(f"deterministic and sampled trees differ in width: {plain.max_nodes} "
                         f"vs {drawn.max_nodes}")
    row = sampled.view(-1, 1)
    return DraftTree(
        tokens=torch.where(row, drawn.tokens, plain.tokens),
        parents=torch.where(row, drawn.parents, plain.parents),
        depths=torch.where(row, drawn.depths, plain.depths),
        num_nodes=torch.where(sampled, drawn.num_nodes, plain.num_nodes),
        draft_logq=torch.where(row, drawn.draft_logq, plain.draft_logq),
        max_depth=max(plain.max_depth, drawn.max_depth),
        pool_ids=drawn.pool_ids,
        proposal_logq=drawn.proposal_logq.masked_fill(~row[..., None], float("-inf")),
    )


class DraftRound:
    """One draft round of fixed shapes, replayed as a CUDA graph on CUDA devices.

    Built for one (tree kind, batch bucket, D, P, budget), as vLLM captures one
    decode graph per batch-size bucket. A call copies the round's inputs into
    static buffers, replays the captured :func:`draft_trees` (no host read, no
    allocation) and returns copies of the bucket's first rows; a call with
    fewer requests than the bucket leaves the other rows' buffers as they were
    (every op is per request, so they never touch the real rows). Off CUDA, or
    with ``graph=False``, the same buffers run :func:`draft_trees` eagerly.

    Args:
        tree, budget, weaver, fanout, expand_width, backend: as in
            :func:`draft_trees`; the Weaver's tables must be prepared.
        batch: the bucket's request count; depth, pool_size: D and P of the pools.
        device: where the round runs; d_model (tree "weaver"): the width of
            h_v and the DFlash states, the Weaver's.
        pool: a CUDA graph memory pool (``torch.cuda.graph_pool_handle()``) to capture
            into, shared with other rounds: each round's intermediates live only
            within its replay, so rounds replayed one at a time on one stream can
            share theirs (as vLLM's graphs share one pool); outputs and input
            buffers stay the round's own. None: a private pool.
    """

    def __init__(
        self,
        tree: str,
        batch: int,
        depth: int,
        pool_size: int,
        budget: int,
        *,
        device: torch.device | str,
        weaver: Weaver | None = None,
        fanout: int = DEFAULT_FANOUT,
        expand_width: int | None = None,
        backend: str = "auto",
        graph: bool = True,
        pool=None,
    ):
        if tree not in TREE_KINDS:
            raise ValueError(f"tree must be one of {list(TREE_KINDS)}, got {tree!r}")
        if tree == "weaver" and weaver is None:
            raise ValueError("tree 'weaver' needs weaver")
        for name, value in (("batch", batch), ("depth", depth), ("pool_size", pool_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        device = torch.device(device)
        self.tree, self.batch, self.budget = tree, batch, budget
        self.weaver, self.fanout, self.expand_width = weaver, fanout, expand_width
        self.backend = backend
        # Valid placeholder inputs: distinct pool ids and finite scores per row.
        ids = torch.arange(pool_size, device=device).expand(batch, depth, -1).contiguous()
        self.pools = CandidatePools(ids, torch.zeros(batch, depth, pool_size, device=device))
        self.root_tokens = torch.zeros(batch, dtype=torch.int64, device=device)
        self.h_v = self.dflash_hidden = None
        if weaver is not None:
            width = weaver.config.d_model
            self.h_v = torch.zeros(batch, width, dtype=weaver.dtype, device=device)
            self.dflash_hidden = torch.zeros(batch, depth, width, dtype=weaver.dtype,
                                             device=device)
        self.graph = None
        self.output = None
        if graph and device.type == "cuda":
            self._capture(pool)

    def _run(self) -> DraftTree:
        with torch.no_grad():
            return draft_trees(
                self.tree, self.root_tokens, self.pools, self.budget, weaver=self.weaver,
                h_v=self.h_v, dflash_hidden=self.dflash_hidden, fanout=self.fanout,
                expand_width=self.expand_width, validate=False, backend=self.backend,
            )

    def _capture(self, pool) -> None:
        # Warm up on a side stream first: Triton compiles and cuBLAS picks its
        # workspaces outside the capture.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._run()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.output = self._run()

    def __call__(
        self,
        root_tokens: torch.Tensor,
        pools: CandidatePools,
        h_v: torch.Tensor | None = None,
        dflash_hidden: torch.Tensor | None = None,
    ) -> DraftTree:
        """The trees of ``n <= batch`` requests; inputs as in :func:`draft_trees`
        with the bucket's D and P (h_v and dflash_hidden for tree "weaver")."""
        n = root_tokens.shape[0]
        if not 1 <= n <= self.batch:
            raise ValueError(f"root_tokens holds {n} requests; this round takes 1..{self.batch}")
        expected = (n, *self.pools.ids.shape[1:])
        if tuple(pools.ids.shape) != expected or tuple(pools.scores.shape) != expected:
            raise ValueError(f"pools must be [n, D, P] = {list(expected)}, got ids "
                             f"{list(pools.ids.shape)} and scores {list(pools.scores.shape)}")
        self.root_tokens[:n] = root_tokens
        self.pools.ids[:n] = pools.ids
        self.pools.scores[:n] = pools.scores
        if self.weaver is not None:
            if h_v is None or dflash_hidden is None:
                raise ValueError("tree 'weaver' needs h_v and dflash_hidden")
            if h_v.shape != (n, *self.h_v.shape[1:]) or dflash_hidden.shape != (
                n, *self.dflash_hidden.shape[1:]
            ):
                raise ValueError(
                    f"h_v must be {[n, *self.h_v.shape[1:]]} and dflash_hidden "
                    f"{[n, *self.dflash_hidden.shape[1:]]}, got {list(h_v.shape)} and "
                    f"{list(dflash_hidden.shape)}"
                )
            self.h_v[:n] = h_v
            self.dflash_hidden[:n] = dflash_hidden
        if self.graph is None:
            trees = self._run()
        else:
            self.graph.replay()
            trees = self.output
        return trees.select(torch.arange(n, device=trees.tokens.device))
