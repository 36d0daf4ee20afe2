"""The draft tree of one decoding step, batched over requests.

Per request, node 0 is the ROOT: the bonus token of the previous step (depth
0, parent -1). Nodes 1..n-1 are drafted tokens in topological order (a
parent's index is smaller than its children's). Requests hold different node
counts; columns past ``num_nodes[r]`` are padding.

Two kinds of tree exist and the verifiers treat them differently:

* deterministic trees (chain, DDTree, Weaver best-first): the tree is a
  function of the drafter's outputs. ``pool_ids`` and ``proposal_logq`` are
  None.
* sampled trees (``build_weaver_tree`` with seeds, ``build_sampled_tree`` in
  :mod:`vllm_tfm.drafting.builders`): the
  children of every expanded node are an ordered sample without replacement
  from the drafter's distribution over that node's pool row, in node order.
  They carry that distribution (``proposal_logq``) because traversal
  verification needs its full support, not only the drawn children.

The sampled builders and the verifiers draw counter-based random numbers
(:mod:`triton_ops.counter_random`): a uniform is a hash of (request seed,
stream, counter), so a request's draws do not depend on the batch it sits in
or on the device; :func:`derive_seeds` gives a fresh seed per use.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from triton_ops.counter_random import mix64
from triton_ops.tree_metadata import TreeMetadata, build_tree_metadata


@dataclass(frozen=True)
class DraftTree:
    """A batch of R draft trees of at most N nodes each.

    Attributes:
        tokens: [R, N] int64 token of each node; padding holds 0.
        parents: [R, N] int32 parent index, -1 for the root and padding.
        depths: [R, N] int32 depth (root 0); padding holds 0.
        num_nodes: [R] int32 real nodes per request, root included (>= 1).
        draft_logq: [R, N] float32 log q(token_i | path to its parent) under the
            drafter that proposed it; 0 for the root and padding.
        max_depth: the builder's depth limit; no node is deeper.
        pool_ids: [R, D, P] int64 candidate pools (row d = candidates of depth
            d + 1), sampled trees only.
        proposal_logq: [R, N, P] float32 log q over pool row ``depths[r, i]`` at
            each expanded node i (the distribution its children were drawn
            from), -inf on the rows of nodes that were not expanded; sampled
            trees only.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    num_nodes: torch.Tensor
    draft_logq: torch.Tensor
    max_depth: int
    pool_ids: torch.Tensor | None = None
    proposal_logq: torch.Tensor | None = None

    def __post_init__(self) -> None:
        _check_layout(self)

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def max_nodes(self) -> int:
        return self.tokens.shape[1]

    @property
    def sampled(self) -> bool:
        """Children were drawn from ``proposal_logq`` (see the module docstring)."""
        return self.proposal_logq is not None

    @property
    def valid(self) -> torch.Tensor:
        """[R, N] bool, ``i < num_nodes[r]``."""
        node = torch.arange(self.max_nodes, device=self.tokens.device)
        return node < self.num_nodes.view(-1, 1)

    def children(self, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Children of every node, in node order.

        Args:
            width: K, at least the largest child count (None: that count, one host read).

        Returns:
            children: [R, N, K] int64 node indices, -1 padded.
            counts: [R, N] int64 number of children.
        """
        R, N = self.tokens.shape
        device = self.tokens.device
        parent = torch.where(self.valid, self.parents.long(), -1)
        # is_child[r, v, i]: node i hangs under node v.
        is_child = parent[:, None, :] == torch.arange(N, device=device)[None, :, None]
        counts = is_child.sum(-1)
        if width is None:
            width = int(counts.max()) if N > 0 else 0
        rank = is_child.long().cumsum(-1) - 1
        slot = torch.gather(rank, 1, parent.clamp(min=0)[:, None, :]).squeeze(1)  # [R, N]
        dump = N * width  # padding nodes write to one scratch column, dropped below
        target = torch.where(parent >= 0, parent * width + slot, dump)
        table = torch.full((R, N * width + 1), -1, dtype=torch.int64, device=device)
        table.scatter_(1, target, torch.arange(N, device=device).expand(R, N).contiguous())
        return table[:, :dump].view(R, N, width), counts

    def to_metadata(self, conv_width: int = 4) -> TreeMetadata:
        """The tree-kernel metadata (ancestor masks, conv taps) of these trees."""
        return build_tree_metadata(self.parents, self.num_nodes, conv_width, validate=False)

    def select(self, rows: torch.Tensor) -> DraftTree:
        """The trees of requests ``rows`` ([R'] int64 indices into dim 0)."""
        rows = rows.to(self.tokens.device).long()
        pick = lambda t: None if t is None else t.index_select(0, rows)  # noqa: E731
        return DraftTree(
            tokens=pick(self.tokens),
            parents=pick(self.parents),
            depths=pick(self.depths),
            num_nodes=pick(self.num_nodes),
            draft_logq=pick(self.draft_logq),
            max_depth=self.max_depth,
            pool_ids=pick(self.pool_ids),
            proposal_logq=pick(self.proposal_logq),
        )

    def truncate(self, num_nodes: torch.Tensor) -> DraftTree:
        """Keep the first ``min(num_nodes[r], self.num_nodes[r])`` nodes of each tree.

        A prefix of a topological order is a tree, and for sampled trees it
        keeps a prefix of every node's sample order, so both stay valid
        drafts. ``num_nodes``: [R] int, each >= 1. N is unchanged.
        """
        if num_nodes.shape != (self.batch_size,):
            raise ValueError(
                f"num_nodes must have shape [{self.batch_size}], got {list(num_nodes.shape)}"
            )
        keep = torch.minimum(self.num_nodes, num_nodes.to(self.num_nodes))
        node = torch.arange(self.max_nodes, device=self.tokens.device)
        valid = node < keep.view(-1, 1)
        proposal = self.proposal_logq
        if proposal is not None:
            proposal = proposal.masked_fill(~valid[..., None], float("-inf"))
        return DraftTree(
            tokens=torch.where(valid, self.tokens, 0),
            parents=torch.where(valid, self.parents, -1),
            depths=torch.where(valid, self.depths, 0),
            num_nodes=keep.to(torch.int32),
            draft_logq=torch.where(valid, self.draft_logq, 0.0),
            max_depth=self.max_depth,
            pool_ids=self.pool_ids,
            proposal_logq=proposal,
        )

    def validate(self, vocab_size: int | None = None) -> None:
        """Check the content (reads the device): raises ValueError naming the field.

        Checked: node counts, root fields, topological parents, depths =
        parent depth + 1 and <= max_depth, padding, distinct sibling tokens,
        token range, NaN-free log-probs, and for sampled trees that each
        drafted token sits in its parent's pool row.
        """
        R, N = self.tokens.shape
        if bool(((self.num_nodes < 1) | (self.num_nodes > N)).any()):
            raise ValueError(f"num_nodes must lie in [1, {N}], got {self.num_nodes.tolist()}")
        valid = self.valid
        drafted = valid.clone()
        drafted[:, 0] = False
        node = torch.arange(N, device=self.tokens.device)
        root = node == 0
        _fail_at(root & (self.parents != -1), "parents", "the root's parent must be -1")
        _fail_at(root & (self.depths != 0), "depths", "the root's depth must be 0")
        _fail_at(~valid & (self.parents != -1), "parents", "padding parents must be -1")
        parent = self.parents.long()
        _fail_at(
            drafted & ((parent < 0) | (parent >= node)),
            "parents", "a drafted node's parent must lie in [0, node) (topological order)",
        )
        parent_depth = torch.gather(self.depths, 1, parent.clamp(min=0))
        _fail_at(drafted & (self.depths != parent_depth + 1), "depths",
                 "a node's depth must be its parent's depth + 1")
        _fail_at(valid & (self.depths > self.max_depth), "depths",
                 f"depths must be <= max_depth = {self.max_depth}")
        _fail_at(valid & (self.tokens < 0), "tokens", "tokens must be >= 0")
        if vocab_size is not None:
            _fail_at(valid & (self.tokens >= vocab_size), "tokens",
                     f"tokens must be < vocab size {vocab_size}")
        _fail_at(valid & torch.isnan(self.draft_logq), "draft_logq", "draft_logq is NaN")
        same = (parent[:, :, None] == parent[:, None, :]) & (
            self.tokens[:, :, None] == self.tokens[:, None, :]
        )
        same &= drafted[:, :, None] & drafted[:, None, :]
        same &= ~torch.eye(N, dtype=torch.bool, device=self.tokens.device)
        _fail_at(same.any(-1), "tokens", "two children of one node hold the same token")
        if self.sampled:
            rows = self.pool_ids[
                torch.arange(R, device=self.tokens.device)[:, None],
                parent_depth.long().clamp(max=self.pool_ids.shape[1] - 1),
            ]  # [R, N, P]: the pool each node was drawn from
            in_pool = (rows == self.tokens[..., None]).any(-1)
            _fail_at(drafted & ~in_pool, "tokens", "a sampled node's token is not in its pool row")
            _fail_at(valid[..., None] & torch.isnan(self.proposal_logq), "proposal_logq",
                     "proposal_logq is NaN")


def _fail_at(bad: torch.Tensor, field: str, message: str) -> None:
    if bool(bad.any()):
        where = ", ".join(str(i) for i in bad.nonzero()[0].tolist())
        raise ValueError(f"{field}[{where}]: {message}")


def _check_layout(tree: DraftTree) -> None:
    """Shapes, dtypes and devices only: no host read."""
    if tree.tokens.dim() != 2 or tree.tokens.shape[1] < 1:
        raise ValueError(f"tokens must be [R, N] with N >= 1, got {list(tree.tokens.shape)}")
    R, N = tree.tokens.shape
    device = tree.tokens.device
    expected = {
        "tokens": ((R, N), (torch.int64,)),
        "parents": ((R, N), (torch.int32,)),
        "depths": ((R, N), (torch.int32,)),
        "num_nodes": ((R,), (torch.int32,)),
        "draft_logq": ((R, N), (torch.float32,)),
    }
    for name, (shape, dtypes) in expected.items():
        t = getattr(tree, name)
        if tuple(t.shape) != shape or t.dtype not in dtypes:
            raise ValueError(
                f"{name} must be {dtypes[0]} of shape {list(shape)}, got {t.dtype} {list(t.shape)}"
            )
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, tokens on {device}")
    depth = tree.max_depth
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
        raise ValueError(f"max_depth must be an int >= 0, got {tree.max_depth!r}")
    if (tree.pool_ids is None) != (tree.proposal_logq is None):
        raise ValueError("pool_ids and proposal_logq must be given together (sampled trees)")
    if tree.pool_ids is not None:
        pool = tree.pool_ids
        if pool.dim() != 3 or pool.shape[0] != R or pool.dtype != torch.int64:
            raise ValueError(
                f"pool_ids must be int64 [R={R}, D, P], got {pool.dtype} {list(pool.shape)}"
            )
        if pool.shape[1] < tree.max_depth:
            raise ValueError(f"pool_ids holds {pool.shape[1]} rows, max_depth is {tree.max_depth}")
        shape = (R, N, pool.shape[2])
        if tuple(tree.proposal_logq.shape) != shape or tree.proposal_logq.dtype != torch.float32:
            raise ValueError(
                f"proposal_logq must be float32 of shape {list(shape)}, "
                f"got {tree.proposal_logq.dtype} {list(tree.proposal_logq.shape)}"
            )
        for name in ("pool_ids", "proposal_logq"):
            if getattr(tree, name).device != device:
                raise ValueError(f"{name} is on {getattr(tree, name).device}, tokens on {device}")


def derive_seeds(seeds: torch.Tensor, counter: torch.Tensor | int) -> torch.Tensor:
    """[R] int64 seeds for one use (e.g. one decoding step) of per-request seeds.

    ``counter`` ([R] int64 or an int, e.g. the number of tokens generated so
    far) must differ between uses, so consecutive steps draw fresh numbers.
    """
    return mix64(mix64(seeds.long()) + counter)
