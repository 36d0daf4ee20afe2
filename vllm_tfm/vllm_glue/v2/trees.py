"""Draft trees kept by request slot, and the tree step of a V2 batch.

Model runner V2 keeps every per-request tensor by request slot (``idx_mapping`` maps a
batch row to its slot) and dispatches FULL graphs for uniform batches of exactly 1 + k
tokens per request, k the step's budget (num_speculative_tokens, or a smaller k of the
batch-size schedule). The slots are N = 1 + num_speculative_tokens wide; a step of
budget k scores the first 1 + k nodes of each tree. A tree the builder left smaller than
its budget is padded with children of the root that repeat the root's token
(``kernel_parents``). They are scored like any node and never verified: verification
reads the trees cut to their real nodes (``gather``).

An engine whose options draft sampled trees (``verify.draws_sampled_trees``) also keeps each
slot's candidate pools and proposals (what traversal verification reads: ~200 KB a slot at
D = 15, P = 512, N = 65) and, on the host, whether the slot's last tree was sampled.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from vllm_tfm.drafting.tree import DraftTree
from vllm_tfm.vllm_glue.tree_step import TreeStep, build_tree_step, tree_position_shifts


@dataclasses.dataclass(frozen=True)
class SlotTrees:
    """The last tree drafted for each request slot, [slots, N] (N = 1 + budget)."""

    tokens: torch.Tensor  # [slots, N] int64, padding nodes hold the root's token
    parents: torch.Tensor  # [slots, N] int32, -1 past num_nodes (as DraftTree)
    depths: torch.Tensor  # [slots, N] int32
    num_nodes: torch.Tensor  # [slots] int32 real nodes, root included
    draft_logq: torch.Tensor  # [slots, N] float32
    max_depth: int
    # Sampled trees' draws (None: the engine drafts none): [slots, D, P] int64 pools and
    # [slots, N, P] float32 proposals, as DraftTree's; and, on the host, [slots] bool: the
    # slot's last tree was sampled (set by the speculator, which knows it on the host).
    pool_ids: torch.Tensor | None = None
    proposal_logq: torch.Tensor | None = None
    sampled: np.ndarray | None = None

    @classmethod
    def allocate(cls, num_slots: int, num_nodes: int, max_depth: int,
                 device: torch.device, pools: tuple[int, int] | None = None) -> SlotTrees:
        """``pools``: (D, P) of the sampled trees' candidate pools (None: no sampled trees)."""
        def zeros(dtype, *shape):
            return torch.zeros(num_slots, *shape, dtype=dtype, device=device)

        parents = zeros(torch.int32, num_nodes) - 1
        draws = {}
        if pools is not None:
            depth, pool = pools
            draws = dict(pool_ids=zeros(torch.int64, depth, pool),
                         proposal_logq=zeros(torch.float32, num_nodes, pool) - float("inf"),
                         sampled=np.zeros(num_slots, dtype=bool))
        return cls(tokens=zeros(torch.int64, num_nodes), parents=parents,
                   depths=zeros(torch.int32, num_nodes),
                   num_nodes=zeros(torch.int32) + 1,
                   draft_logq=zeros(torch.float32, num_nodes), max_depth=max_depth, **draws)

    @property
    def width(self) -> int:
        return self.tokens.shape[1]

    def store(self, slots: torch.Tensor, trees: DraftTree) -> None:
        """Keep ``trees`` (one per entry of ``slots``, at most N nodes) in their slots."""
        rows, width = trees.tokens.shape
        if width > self.width:
            raise ValueError(f"trees of {width} nodes do not fit slots of {self.width}")
        if trees.max_depth > self.max_depth:
            raise ValueError(f"trees of depth {trees.max_depth} exceed the slots' "
                             f"max_depth {self.max_depth}")
        slots = slots.long()
        node = torch.arange(self.width, device=slots.device)
        real = node < trees.num_nodes.view(-1, 1)
        pad = (0, self.width - width)
        root = trees.tokens[:, :1]
        tokens = torch.nn.functional.pad(trees.tokens, pad)
        self.tokens[slots] = torch.where(real, tokens, root)
        self.parents[slots] = torch.nn.functional.pad(trees.parents.int(), pad, value=-1)
        self.depths[slots] = torch.nn.functional.pad(trees.depths.int(), pad)
        self.num_nodes[slots] = trees.num_nodes.int()
        self.draft_logq[slots] = torch.nn.functional.pad(trees.draft_logq.float(), pad)
        if trees.sampled:
            if self.proposal_logq is None:
                raise ValueError("sampled trees in slots allocated without pools")
            self.pool_ids[slots] = trees.pool_ids
            self.proposal_logq[slots] = torch.nn.functional.pad(
                trees.proposal_logq, (0, 0, 0, self.width - width), value=float("-inf"))

    def clear(self, slot: int) -> None:
        """A new request in ``slot``: no tree (a root alone) until it drafts one."""
        self.parents[slot] = -1
        self.num_nodes[slot] = 1
        if self.sampled is not None:
            self.sampled[slot] = False

    def sampled_rows(self, slots: np.ndarray) -> np.ndarray:
        """[R] bool on the host: the last tree of each of ``slots`` was sampled."""
        if self.sampled is None:
            return np.zeros(len(slots), dtype=bool)
        return self.sampled[slots]

    def draft_tokens(self, slots: torch.Tensor, num_drafts: int) -> torch.Tensor:
        """[R, N - 1] the tokens vLLM schedules after each slot's root: the first
        ``num_drafts`` nodes after it (the step's k), -1 past them."""
        tokens = self.tokens[slots.long(), 1:]
        tokens[:, num_drafts:] = -1
        return tokens

    def gather(self, slots: torch.Tensor, draws: bool = False,
               num_nodes: torch.Tensor | None = None) -> DraftTree:
        """The trees of ``slots``, real nodes only (what verification reads); ``draws``:
        with their pools and proposals (a batch holding sampled trees). ``num_nodes`` [R]:
        each tree cut to at most that many nodes (the nodes a step scored), by the same
        ``DraftTree.truncate`` that cuts the slots' padding."""
        slots = slots.long()
        stored = self.num_nodes[slots]
        pools = {}
        if draws:
            pools = dict(pool_ids=self.pool_ids[slots], proposal_logq=self.proposal_logq[slots])
        tree = DraftTree(tokens=self.tokens[slots], parents=self.parents[slots],
                         depths=self.depths[slots], num_nodes=stored,
                         draft_logq=self.draft_logq[slots], max_depth=self.max_depth, **pools)
        return tree.truncate(stored if num_nodes is None else num_nodes)

    def kernel_parents(self, slots: torch.Tensor) -> torch.Tensor:
        """[R, N] int64 parents the kernels score: padding nodes hang under the root."""
        slots = slots.long()
        node = torch.arange(self.width, device=slots.device)
        real = node < self.num_nodes[slots].view(-1, 1)
        parents = torch.where(real, self.parents[slots].long(), 0)
        parents[:, 0] = -1
        return parents


def batch_tree_step(input_batch, trees: SlotTrees, conv_width: int,
                    draftless: bool = False) -> TreeStep | None:
    """The tree step of a V2 batch (None: no request carries drafts, unless ``draftless``
    asks for a step of one-node trees all the same).

    A request with d scheduled drafts is scored as the first 1 + d nodes of its slot's
    tree (node order is topological, so any prefix is a tree); one with none (a prompt
    chunk, a decode without drafts) as a tree of one node, the last scheduled token.
    Prefix lengths come from the batch's device sequence lengths (exact under async
    scheduling too); no sync.
    """
    drafts = input_batch.num_draft_tokens_per_req
    num_reqs = input_batch.num_reqs
    if drafts is None or input_batch.num_draft_tokens == 0:
        if not draftless:
            return None
        num_drafts = np.zeros(num_reqs, dtype=np.int64)
    else:
        num_drafts = np.asarray(drafts[:num_reqs], dtype=np.int64)
    num_nodes = num_drafts + 1
    parents = trees.kernel_parents(input_batch.idx_mapping[:num_reqs])[:, : int(num_nodes.max())]
    return build_tree_step(
        list(input_batch.req_ids[:num_reqs]), parents, num_nodes,
        input_batch.query_start_loc_np[: num_reqs + 1].astype(np.int64),
        input_batch.seq_lens[:num_reqs],
        np.asarray(input_batch.num_scheduled_tokens[:num_reqs], dtype=np.int64),
        input_batch.positions, conv_width,
    )


def apply_tree_positions(positions: torch.Tensor, step: TreeStep) -> None:
    """RoPE sees node j at prefix + depth(j) (``positions`` holds prefix + j, in place)."""
    rows, shift = tree_position_shifts(step)
    positions[rows] -= shift


def restore_linear_positions(positions: torch.Tensor, step: TreeStep) -> None:
    """Put back the positions vLLM wrote (the drafter's context reads them)."""
    positions[: step.linear_positions.shape[0]] = step.linear_positions
