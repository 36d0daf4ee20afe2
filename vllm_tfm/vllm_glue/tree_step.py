"""The draft trees the target scores in one forward, shared by the runner and the layers.

The runner builds one :class:`TreeStep` per scoring step (after vLLM prepared
the inputs) and activates it for the target's forward; the attention and GDN
layer patches read it, the GDN layers leave their commit records in it, the
verifier fills the accepted leaves, and the commit consumes it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from triton_ops.tree_metadata import TreeMetadata


def select_requests(meta: TreeMetadata, index: torch.Tensor) -> TreeMetadata:
    """The metadata of a subset of requests (``index`` into dim 0)."""
    return TreeMetadata(
        **{
            field.name: getattr(meta, field.name).index_select(0, index)
            for field in dataclasses.fields(TreeMetadata)
        }
    )


@dataclasses.dataclass
class GDNCommitRecord:
    """What one GDN layer needs to commit the accepted path after verification."""

    ssm_state: torch.Tensor  # [slots, HV, K, V] view of the layer's pool
    conv_state: torch.Tensor  # [slots, C, W-1] view of the committed conv columns
    slots: torch.Tensor  # [R'] state slot per spec request
    requests: torch.Tensor  # [R'] indices into the step's requests
    meta: TreeMetadata  # the step's metadata restricted to those requests
    verify_out: Any  # gdn_tree_verify's output (carries what commit needs)
    conv_inputs: torch.Tensor  # [R', N, C] pre-conv node inputs


@dataclasses.dataclass
class TreeStep:
    """One target forward over root + draft nodes, for every request of the batch.

    Requests without drafts (prompt chunks, zero-draft decodes) are trees of
    one node: the last scheduled token. ``token_rows[r, j]`` is the row of node
    ``j`` of request ``r`` in the flattened batch; ``prefix_lens[r]`` counts the
    committed tokens before its root.
    """

    req_ids: list[str]
    meta: TreeMetadata  # [R, N]
    token_rows: torch.Tensor  # [R, N] int64, -1 for padding
    prefix_lens: torch.Tensor  # [R] int32
    num_scheduled: torch.Tensor  # [R] int32 tokens scheduled this step
    linear_positions: torch.Tensor  # positions vLLM computed, before depth offsets
    has_trees: bool  # some request has draft nodes (known on the host, no sync)
    gdn_records: list[GDNCommitRecord] = dataclasses.field(default_factory=list)
    accepted_leaf: torch.Tensor | None = None  # [R], set by the verifier
    # [R] bool, requests whose tree was lost after vLLM scheduled its drafts (see
    # runner._build_step): their nodes are scored as a chain, which keeps every layer's
    # input well-formed, and only the root is verified (its bonus token is exact, the
    # drafts are never accepted). None: no tree was lost.
    void: torch.Tensor | None = None

    @property
    def only_tree_rows(self) -> bool:
        """Every scheduled token is a node of a tree with drafts: no prompt chunk and no
        decode without drafts (a tree of one node, which tree attention leaves to vLLM)."""
        num_nodes = self.meta.num_nodes.to(self.num_scheduled.device)
        return bool(((self.num_scheduled == num_nodes) & (num_nodes > 1)).all())

    def tree_requests(self) -> torch.Tensor:
        """Indices of the requests whose tree has more than the root."""
        return (self.meta.num_nodes > 1).nonzero().flatten()

    def bonus_rows(self) -> torch.Tensor:
        """[R] row whose logits produced each request's new token."""
        assert self.accepted_leaf is not None
        leaf = self.accepted_leaf.long().clamp(min=0).view(-1, 1)
        return torch.gather(self.token_rows, 1, leaf).flatten()

    def context_order(self) -> torch.Tensor:
        """Row permutation that puts each request's accepted path first.

        The drafter's context must be [root, accepted nodes by depth, the
        rest]: then the path sits at the linear positions prefix + depth and
        the rejected rows after it, exactly where a chain drafter expects them.
        """
        assert self.accepted_leaf is not None
        total = int(self.linear_positions.shape[-1])
        order = torch.arange(total, device=self.token_rows.device)
        on_path = self.meta.path_mask(self.accepted_leaf)
        valid = self.meta.valid
        # Sort key per node: path nodes by depth first, then the others in order.
        N = self.meta.max_nodes
        node = torch.arange(N, device=order.device).expand_as(self.token_rows)
        key = torch.where(on_path, self.meta.depths.long(), N + node)
        key = torch.where(valid, key, 3 * N + node)
        ranked = torch.argsort(key, dim=1, stable=True)
        sources = torch.gather(self.token_rows, 1, ranked)
        targets = self.token_rows
        mask = valid
        order[targets[mask]] = sources[mask]
        return order


_active: TreeStep | None = None


def activate(step: TreeStep | None) -> None:
    global _active
    _active = step


def active() -> TreeStep | None:
    return _active
