"""Tree steps inside vLLM's FULL CUDA graphs (model runner V1).

vLLM captures one FULL graph per uniform decode batch size: R requests of
1 + k tokens each (k = num_speculative_tokens), and replays it with no Python
run, reading every input from the address it had during capture. So for each
captured size this module keeps a :class:`~.tree_step.TreeStep` of R requests
whose tensors are fixed buffers (:func:`capture_step`), active while vLLM warms
up and captures that size: the graph then holds the tree kernels, over those
buffers. A step whose every request scores a tree of exactly k drafts takes the
graph of its padded size: its trees are copied into the first rows of that
size's buffers before the replay (:meth:`GraphedTreeSteps.bind`); the padding
requests keep a tree they held before, and state slot / block table rows that
vLLM points at its null block, so every op of theirs stays finite and theirs
alone. Any other step (prompt chunks, smaller trees, a lost tree) runs eagerly.

The GDN layers leave their commit records in the step they run with: during
capture, records whose tensors are graph memory that every replay of that
graph rewrites. The replayed step commits through those records, cut to its
own requests (:meth:`~.tree_step.GDNCommitRecord.first_requests`), and so its
commit reads nothing but fixed buffers and the accepted leaves: on CUDA it is
a graph of its own per (captured size, request count) (:meth:`GraphedTreeSteps.
commit`), since eagerly its ~100 small kernel launches cost the host ~8 ms a
step at Qwen3.6-27B's 64 layers (BENCHMARKS.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import torch
from vllm.logger import init_logger

from triton_ops.tree_metadata import TreeMetadata, build_tree_metadata
from vllm_tfm.options import MAX_BATCH, TfmOptions
from vllm_tfm.vllm_glue.tree_step import RequestNodes, TreeStep

logger = init_logger(__name__)


def budget_rule_for_graphs(options: TfmOptions, full_decode_graphs: bool) -> TfmOptions:
    """The options a runner drafts with: under FULL decode graphs, the default budget
    rule becomes the full budget at every batch size.

    V1 captures its uniform decode graphs for one query length, 1 + num_speculative_tokens,
    so the rule's smaller trees would run eagerly — slower than the graphed full budget
    (H200, Qwen3.6-27B shapes, 8 requests: 124 ms a step at budget 64 graphed against 214
    ms at the rule's 16 eager, BENCHMARKS.md). A table the user gave is kept as given.
    """
    if not full_decode_graphs or options.budget_by_batch is not None:
        return options
    return dataclasses.replace(options, budget_by_batch=((MAX_BATCH, options.budget),))


def capture_step(num_reqs: int, num_nodes: int, conv_width: int,
                 device: torch.device) -> TreeStep:
    """The fixed-buffer step of ``num_reqs`` requests of ``num_nodes`` nodes (vLLM's
    capture batch: every request a spec decode with prefix 0), each tree a chain."""
    parents = torch.arange(num_nodes, device=device).expand(num_reqs, -1) - 1
    counts = torch.full((num_reqs,), num_nodes, dtype=torch.int32, device=device)
    meta = build_tree_metadata(parents.contiguous(), counts, conv_width=conv_width,
                               validate=False)
    prefix_lens = torch.zeros(num_reqs, dtype=torch.int32, device=device)
    flat = torch.arange(num_reqs * num_nodes, device=device)
    # Full trees end to end from row 0: the layers move rows by views (dense_start), so
    # the graph holds no gathers (without it, the H100 profile of a 27B tree step counted
    # 176 index copies, ~240 gathers and ~160 fills a step, ~1 ms, 2026-12-05).
    nodes = RequestNodes(requests=torch.arange(num_reqs, device=device), meta=meta,
                         prefix_lens=prefix_lens, rows=flat, slots=flat, dense_start=0)
    step = TreeStep(
        req_ids=[""] * num_reqs,
        meta=meta,
        token_rows=flat.view(num_reqs, num_nodes),
        prefix_lens=prefix_lens,
        num_scheduled=torch.full((num_reqs,), num_nodes, dtype=torch.int32),
        linear_positions=flat,
        has_trees=True,
        tree_nodes=nodes,
        only_tree_rows=True,
        num_nodes_host=np.full(num_reqs, num_nodes, dtype=np.int64),
    )
    # The GDN layers of a capture batch ask for the subset of every request.
    step.prime_spec_nodes(np.ones(num_reqs, dtype=bool), nodes)
    return step


def graphable(step: TreeStep | None, num_nodes: int) -> bool:
    """Whether ``step`` is a uniform decode batch of full trees (the batches vLLM
    replays FULL graphs for), with nothing the graph does not hold (lost trees)."""
    return (
        step is not None
        and step.only_tree_rows
        and step.void is None
        and step.num_nodes_host is not None
        and bool((step.num_nodes_host == num_nodes).all())
    )


class GraphedTreeSteps:
    """One runner's fixed-buffer tree steps, by captured request count."""

    def __init__(self, num_nodes: int, conv_width: int, device: torch.device):
        self.num_nodes = num_nodes
        self.conv_width = conv_width
        self.device = device
        self.steps: dict[int, TreeStep] = {}
        # By captured request count: the accepted leaves a commit graph reads.
        self._accepted_leaf: dict[int, torch.Tensor] = {}
        # (captured request count, a step's request count) -> that graph's metadata and
        # commit records cut to the step's requests; the commit graph over them.
        self._cut: dict[tuple[int, int], tuple[TreeMetadata, dict]] = {}
        self._commit_graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._eager_commits: set[tuple[int, int]] = set()  # whose capture failed
        self._commit_pool = None

    def for_capture(self, num_tokens: int) -> TreeStep:
        """The step active while vLLM warms up and captures ``num_tokens`` tokens of
        uniform decodes; made once per size and kept (the graph reads its buffers)."""
        num_reqs, rest = divmod(num_tokens, self.num_nodes)
        if rest:
            raise RuntimeError(
                f"dflash_tfm: vLLM captures a uniform decode graph of {num_tokens} tokens, "
                f"not a multiple of 1 + num_speculative_tokens = {self.num_nodes}"
            )
        # A capture writes the records anew: cuts and commit graphs over old ones go.
        self._cut.clear()
        self._commit_graphs.clear()
        step = self.steps.get(num_reqs)
        if step is None:
            step = capture_step(num_reqs, self.num_nodes, self.conv_width, self.device)
            self.steps[num_reqs] = step
            self._accepted_leaf[num_reqs] = torch.zeros(num_reqs, dtype=torch.int64,
                                                        device=self.device)
        step.new_forward()
        return step

    def bind(self, step: TreeStep, num_reqs_padded: int) -> None:
        """Copy ``step``'s trees into the buffers the captured graph of
        ``num_reqs_padded`` requests replays over, and give ``step`` that graph's commit
        records cut to its requests (views of those buffers, made once per count)."""
        graph_step = self.steps[num_reqs_padded]
        num_reqs = len(step.req_ids)
        for field in dataclasses.fields(TreeMetadata):
            getattr(graph_step.meta, field.name)[:num_reqs].copy_(getattr(step.meta, field.name))
        graph_step.prefix_lens[:num_reqs].copy_(step.prefix_lens)
        step.gdn_records = dict(self._cut_to(num_reqs_padded, num_reqs)[1])
        step.graph_size = num_reqs_padded

    def _cut_to(self, num_reqs_padded: int, num_reqs: int) -> tuple[TreeMetadata, dict]:
        """The metadata and commit records of the graph of ``num_reqs_padded`` requests
        cut to its first ``num_reqs`` (views of its buffers, made once per count)."""
        key = (num_reqs_padded, num_reqs)
        cut = self._cut.get(key)
        if cut is None:
            graph_step = self.steps[num_reqs_padded]
            meta = TreeMetadata(**{field.name: getattr(graph_step.meta, field.name)[:num_reqs]
                                   for field in dataclasses.fields(TreeMetadata)})
            requests = graph_step.tree_nodes.requests[:num_reqs]
            records = {name: record.first_requests(num_reqs, meta, requests)
                       for name, record in graph_step.gdn_records.items()}
            cut = self._cut[key] = (meta, records)
        return cut

    def has_commit_graph(self, step: TreeStep) -> bool:
        """Whether :meth:`commit` of the bound ``step`` replays a captured commit graph."""
        return (step.graph_size, len(step.req_ids)) in self._commit_graphs

    def commit(self, step: TreeStep, commit: Callable[[TreeStep], None]) -> None:
        """Commit a bound ``step`` (its accepted leaves set) by ``commit`` run over the
        buffers of its graph, so that the same launches serve every step of that size
        and count: on CUDA they are captured as a CUDA graph the first time that
        (size, count) commits (which runs eagerly, compiling any kernel first) and
        replayed after."""
        num_reqs = len(step.req_ids)
        key = (step.graph_size, num_reqs)
        leaf = self._accepted_leaf[step.graph_size][:num_reqs]
        leaf.copy_(step.accepted_leaf)
        graph = self._commit_graphs.get(key)
        if graph is not None:
            graph.replay()
            return
        meta, records = self._cut_to(*key)
        fixed = dataclasses.replace(step, meta=meta, accepted_leaf=leaf, gdn_records=records,
                                    prefix_lens=self.steps[step.graph_size].prefix_lens[:num_reqs])
        commit(fixed)
        if self.device.type != "cuda" or key in self._eager_commits:
            return
        if self._commit_pool is None:
            self._commit_pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._commit_pool,
                                  capture_error_mode="thread_local"):
                commit(fixed)
        except Exception:  # the step is committed already: later ones commit eagerly
            logger.exception("dflash_tfm: capturing the commit of %d requests (graph of %d) "
                             "failed; that commit stays eager", num_reqs, step.graph_size)
            self._eager_commits.add(key)
            return
        self._commit_graphs[key] = graph
