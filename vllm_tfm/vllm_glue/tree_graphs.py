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
own requests (:meth:`~.tree_step.GDNCommitRecord.first_requests`).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from triton_ops.tree_metadata import TreeMetadata, build_tree_metadata
from vllm_tfm.vllm_glue.tree_step import RequestNodes, TreeStep


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
    nodes = RequestNodes(requests=torch.arange(num_reqs, device=device), meta=meta,
                         prefix_lens=prefix_lens, rows=flat, slots=flat)
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
        # (captured request count, a step's request count) -> that graph's commit records
        # cut to the step's requests.
        self._cut_records: dict[tuple[int, int], dict] = {}

    def for_capture(self, num_tokens: int) -> TreeStep:
        """The step active while vLLM warms up and captures ``num_tokens`` tokens of
        uniform decodes; made once per size and kept (the graph reads its buffers)."""
        num_reqs, rest = divmod(num_tokens, self.num_nodes)
        if rest:
            raise RuntimeError(
                f"dflash_tfm: vLLM captures a uniform decode graph of {num_tokens} tokens, "
                f"not a multiple of 1 + num_speculative_tokens = {self.num_nodes}"
            )
        self._cut_records.clear()  # a capture writes the records anew
        step = self.steps.get(num_reqs)
        if step is None:
            step = capture_step(num_reqs, self.num_nodes, self.conv_width, self.device)
            self.steps[num_reqs] = step
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
        key = (num_reqs_padded, num_reqs)
        records = self._cut_records.get(key)
        if records is None:
            meta = TreeMetadata(**{field.name: getattr(graph_step.meta, field.name)[:num_reqs]
                                   for field in dataclasses.fields(TreeMetadata)})
            requests = graph_step.tree_nodes.requests[:num_reqs]
            records = {name: record.first_requests(num_reqs, meta, requests)
                       for name, record in graph_step.gdn_records.items()}
            self._cut_records[key] = records
        step.gdn_records = dict(records)
