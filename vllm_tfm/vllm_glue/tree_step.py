"""The draft trees the target scores in one forward, shared by the runner and the layers.

The runner builds one :class:`TreeStep` per scoring step (after vLLM prepared
the inputs) and puts it in its engine's :class:`StepSlot` for the target's
forward (:func:`active` finds it through vLLM's forward context); the attention and GDN
layer patches read it, the GDN layers leave their commit records in it, the
verifier fills the accepted leaves, and the commit consumes it.

Everything a layer reads is indexed once per step from what the host knows (the
scheduled counts, vLLM's host-side masks): a :class:`RequestNodes` per request
subset (the tree requests for attention, each GDN metadata's spec requests), so
the layers launch no host sync and repeat no per-layer selection.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from triton_ops.tree_metadata import TreeMetadata, build_tree_metadata, path_first_order
from triton_ops.utils import capturing_graph


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """``array`` on ``device`` without waiting for the GPU: a blocking host-to-device
    copy synchronises the stream, so a step built while the target's graph or the
    drafter still runs would stall the host until they finish (H200: 29 ms a step in
    one such copy, BENCHMARKS.md "Stop 15 device calls"). From pinned memory the copy
    is queued; the pinned buffer is fresh, so nothing rewrites it before it lands."""
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def select_requests(meta: TreeMetadata, index: torch.Tensor) -> TreeMetadata:
    """The metadata of a subset of requests (``index`` into dim 0)."""
    return TreeMetadata(
        **{
            field.name: getattr(meta, field.name).index_select(0, index)
            for field in dataclasses.fields(TreeMetadata)
        }
    )


@dataclasses.dataclass(frozen=True)
class RequestNodes:
    """A subset of the step's requests, in node layout [R', N], with the indices that
    move rows between it and a flat token layout (the batch's, or a layer's spec rows).

    ``rows[v]`` and ``slots[v]`` pair the flat row of the v-th real node (request-major,
    node order) with its place in the flattened [R' * N] layout. When the nodes fill the
    flat rows ``dense_start`` .. ``dense_start + R' * N`` in that order (every request has
    N nodes, laid end to end: a decode batch of full trees, what every FULL graph holds),
    both layouts are the same memory and the moves below are views, not launches.
    """

    requests: torch.Tensor  # [R'] int64, indices into the step's requests
    meta: TreeMetadata  # [R', N], the step's metadata of those requests
    prefix_lens: torch.Tensor  # [R'] int32
    rows: torch.Tensor  # [V] int64
    slots: torch.Tensor  # [V] int64
    dense_start: int | None = None

    def to_nodes(self, flat: torch.Tensor) -> torch.Tensor:
        """[T, ...] flat rows -> [R', N, ...] by node, zeros for padding (a view of
        ``flat`` when dense)."""
        R, N = self.meta.parents.shape
        if self.dense_start is not None:
            return flat[self.dense_start : self.dense_start + R * N].view(R, N, *flat.shape[1:])
        by_node = flat.new_zeros(R * N, *flat.shape[1:])
        by_node.index_copy_(0, self.slots, flat.index_select(0, self.rows))
        return by_node.view(R, N, *flat.shape[1:])

    def real_nodes(self, by_node: torch.Tensor) -> torch.Tensor:
        """[R', N, ...] -> [V, ...], the real nodes in ``rows`` order."""
        if self.dense_start is not None:
            return by_node.flatten(0, 1)
        return by_node.flatten(0, 1).index_select(0, self.slots)

    def write_rows(self, flat: torch.Tensor, by_node: torch.Tensor) -> None:
        """Write the real nodes of ``by_node`` [R', N, ...] into their rows of ``flat``."""
        if self.dense_start is not None:
            R, N = self.meta.parents.shape
            flat[self.dense_start : self.dense_start + R * N].copy_(by_node.flatten(0, 1))
        else:
            flat.index_copy_(0, self.rows, self.real_nodes(by_node).to(flat.dtype))


def request_nodes(meta: TreeMetadata, prefix_lens: torch.Tensor, requests: np.ndarray,
                  first_rows: np.ndarray, num_nodes: np.ndarray) -> RequestNodes:
    """The :class:`RequestNodes` of ``requests`` (host indices into the step's requests),
    whose node ``j`` sits at flat row ``first_rows[i] + j`` for ``j < num_nodes[i]``
    (host arrays, one entry per chosen request)."""
    max_nodes = meta.max_nodes
    node = np.arange(max_nodes)
    real = node[None, :] < num_nodes[:, None]
    rows = (first_rows[:, None] + node[None, :])[real]
    slots = (np.arange(len(requests))[:, None] * max_nodes + node[None, :])[real]
    device = meta.parents.device
    index = to_device(np.asarray(requests, dtype=np.int64), device)
    # Every request (a decode batch): the subset is the step itself, no copies.
    everyone = len(requests) == meta.batch_size
    # Every node real and the flat rows consecutive in node-layout order: moves are views.
    dense = (len(rows) == len(requests) * max_nodes > 0
             and bool((rows == rows[0] + slots).all()))
    return RequestNodes(
        requests=index,
        meta=meta if everyone else select_requests(meta, index),
        prefix_lens=prefix_lens if everyone else prefix_lens.index_select(0, index),
        rows=to_device(rows.astype(np.int64), device),
        slots=to_device(slots.astype(np.int64), device),
        dense_start=int(rows[0]) if dense else None,
    )


@dataclasses.dataclass
class GDNCommitRecord:
    """What one GDN layer needs to commit the accepted path after verification."""

    ssm_state: torch.Tensor  # [slots, HV, K, V] view of the layer's pool
    conv_state: torch.Tensor  # [slots, C, W-1] view of the committed conv columns
    slots: torch.Tensor  # [R'] state slot per spec request
    requests: torch.Tensor  # [R'] indices into the step's requests
    meta: TreeMetadata  # the step's metadata restricted to those requests
    verify_out: Any  # gdn_tree_verify's output for the commit (``for_commit``)
    conv_inputs: torch.Tensor  # [R', N, C] pre-conv node inputs

    def first_requests(self, count: int, meta: TreeMetadata,
                       requests: torch.Tensor) -> GDNCommitRecord:
        """The record of this layer's first ``count`` requests, which are the step's
        requests ``requests`` with metadata ``meta`` (a graph's record, cut to the
        requests of the step that replayed it: views, rewritten by each replay)."""
        out = self.verify_out
        return GDNCommitRecord(
            ssm_state=self.ssm_state, conv_state=self.conv_state, slots=self.slots[:count],
            requests=requests, meta=meta,
            verify_out=type(out)(**{name: None if value is None else value[:count]
                                    for name, value in vars(out).items()}),
            conv_inputs=self.conv_inputs[:count],
        )


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
    # The requests with draft nodes, rows in the flat batch (None: no trees). Built with
    # the step, read by every attention layer.
    tree_nodes: RequestNodes | None = None
    # Every scheduled token is a node of a tree with drafts: no prompt chunk and no
    # decode without drafts (a tree of one node, which tree attention leaves to vLLM).
    only_tree_rows: bool = False
    num_nodes_host: np.ndarray | None = None  # [R] int64, the host's copy of meta.num_nodes
    # By GDN layer name: a forward run again over the same step (vLLM's warm-up runs
    # before a graph capture) replaces its layers' records.
    gdn_records: dict[str, GDNCommitRecord] = dataclasses.field(default_factory=dict)
    accepted_leaf: torch.Tensor | None = None  # [R], set by the verifier
    # The captured size whose FULL graph this step replays (GraphedTreeSteps.bind); None:
    # the step runs eagerly.
    graph_size: int | None = None
    # [R] bool, requests whose tree was lost after vLLM scheduled its drafts (see
    # runner._build_step): their nodes are scored as a chain, which keeps every layer's
    # input well-formed, and only the root is verified (its bonus token is exact, the
    # drafts are never accepted). None: no tree was lost.
    void: torch.Tensor | None = None
    # spec_nodes' results, by the host mask's bytes: every GDN layer of a KV-cache group
    # reads the same mask, so the subset is indexed once per group and step.
    _spec_nodes: dict[bytes, RequestNodes] = dataclasses.field(default_factory=dict)
    # state_slots' results, by the slot table's address, its row count and whether a graph
    # was being captured: the GDN layers of a KV-cache group share their metadata's table,
    # so its column becomes int64 once per group and forward (new_forward forgets them).
    _state_slots: dict[tuple[int, int, bool], torch.Tensor] = dataclasses.field(default_factory=dict)

    def spec_nodes(self, spec_mask_cpu: torch.Tensor) -> RequestNodes:
        """The requests vLLM's GDN metadata runs as spec decodes (its host mask [R] bool),
        rows local to their concatenated tokens (vLLM's spec-row order: by request)."""
        mask = spec_mask_cpu.numpy()[: len(self.req_ids)]
        key = mask.tobytes()
        nodes = self._spec_nodes.get(key)
        if nodes is None:
            requests = mask.nonzero()[0]
            counts = self.num_nodes_host[requests]
            # A spec request's scheduled tokens are exactly its tree's nodes.
            first_rows = np.cumsum(counts) - counts
            nodes = request_nodes(self.meta, self.prefix_lens, requests, first_rows, counts)
            self._spec_nodes[key] = nodes
        return nodes

    def state_slots(self, spec_state_indices: torch.Tensor, num_spec: int) -> torch.Tensor:
        """[num_spec] int64, each spec request's committed-state slot: column 0 of vLLM's
        GDN ``spec_state_indices_tensor`` [R, ...]. A copy made outside a CUDA graph capture
        is never reused inside one (V1 runs its warm-ups and the capture over one step,
        without a new_forward between them): the capture records its own copy, which every
        replay redoes."""
        key = (spec_state_indices.data_ptr(), num_spec, capturing_graph(spec_state_indices.device))
        slots = self._state_slots.get(key)
        if slots is None:
            slots = self._state_slots[key] = spec_state_indices[:num_spec, 0].long()
        return slots

    def new_forward(self) -> None:
        """Forget what the last forward over this step computed on the device. A step kept
        for a graph capture runs vLLM's eager warm-up forwards and then the captured one:
        the captured forward must make its own int64 slots, which every replay recomputes
        from the slot table, not read the warm-up's copy of that step's slots."""
        self._state_slots.clear()

    def prime_spec_nodes(self, spec_mask: np.ndarray, nodes: RequestNodes) -> None:
        """Give ``spec_nodes`` its answer for ``spec_mask`` in advance (a step built
        for a graph capture, during which nothing may be copied to the device)."""
        self._spec_nodes[spec_mask.tobytes()] = nodes

    def tree_requests(self) -> torch.Tensor:
        """Indices of the requests whose tree has more than the root."""
        if self.tree_nodes is not None:
            return self.tree_nodes.requests
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
        return path_first_order(self.meta, self.accepted_leaf, self.token_rows,
                                int(self.linear_positions.shape[-1]))


def build_tree_step(req_ids: list[str], parents: torch.Tensor, num_nodes: np.ndarray,
                    query_start: np.ndarray, seq_lens: torch.Tensor, scheduled: np.ndarray,
                    positions: torch.Tensor, conv_width: int,
                    void: torch.Tensor | None = None) -> TreeStep:
    """The step of a batch whose request r scores the first ``num_nodes[r]`` nodes of its
    tree ``parents[r]`` ([R, max nodes] on the device) as its last scheduled tokens (a
    request without drafts: a tree of one node). Host arrays, one entry per request:
    ``query_start`` [R + 1] vLLM's token offsets, ``scheduled`` tokens this step;
    ``seq_lens`` [R] on the device, tokens up to the end of this step (under V2's async
    scheduling only the device knows them: the host's count assumes every draft
    accepted); ``positions`` the batch's linear positions (kept for the drafter). Both
    runners build their steps here, without a host sync."""
    device = parents.device
    max_nodes = parents.shape[1]
    meta = build_tree_metadata(parents, to_device(num_nodes.astype(np.int32), device),
                               conv_width=conv_width, validate=False)
    first_node_row = query_start[1:] - num_nodes
    node = np.arange(max_nodes)
    token_rows = np.where(node[None, :] < num_nodes[:, None],
                          first_node_row[:, None] + node[None, :], -1)
    prefix_lens = (seq_lens.to(device) - meta.num_nodes).to(torch.int32)
    trees = (num_nodes > 1).nonzero()[0]
    return TreeStep(
        req_ids=req_ids,
        meta=meta,
        token_rows=to_device(token_rows, device),
        prefix_lens=prefix_lens,
        num_scheduled=torch.from_numpy(scheduled.astype(np.int32)),
        linear_positions=positions[: int(query_start[-1])].clone(),
        has_trees=len(trees) > 0,
        tree_nodes=(request_nodes(meta, prefix_lens, trees, first_node_row[trees],
                                  num_nodes[trees]) if len(trees) else None),
        only_tree_rows=bool(((scheduled == num_nodes) & (num_nodes > 1)).all()),
        num_nodes_host=num_nodes,
        void=void,
    )


def tree_position_shifts(step: TreeStep) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rows, shift): RoPE sees node j at prefix + depth(j) while vLLM wrote prefix + j,
    so each tree node's position drops by j - depth(j) (slots stay linear). None: no
    tree has drafts (a root's depth is its index, 0)."""
    nodes = step.tree_nodes
    if nodes is None:
        return None
    depths = nodes.meta.depths.long()
    node = torch.arange(nodes.meta.max_nodes, device=depths.device).expand_as(depths)
    return nodes.rows, nodes.real_nodes(node - depths)


# The key of an engine's StepSlot in its static forward context: the per-engine dict vLLM
# hands every forward of that engine's models as ForwardContext.no_compile_layers. Unlike
# a module global, no engine (of any kind) ever sees another engine's step.
STEP_SLOT_KEY = "vllm_tfm.tree_step"


@dataclasses.dataclass
class StepSlot:
    """The tree step of one engine's current target forward; None outside it."""

    step: TreeStep | None = None


def install_step_slot(static_forward_context: dict) -> StepSlot:
    """A fresh slot for the engine whose static forward context this is (a runner made
    anew replaces the slot, and with it whatever a failed forward left in the old one)."""
    slot = StepSlot()
    static_forward_context[STEP_SLOT_KEY] = slot
    return slot


def active() -> TreeStep | None:
    """The step of the forward running now, read from its forward context."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    slot = get_forward_context().no_compile_layers.get(STEP_SLOT_KEY)
    return None if slot is None else slot.step
