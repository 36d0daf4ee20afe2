"""The glue's pure step functions against per-request brute force: which logits row is
which node, the drafter's context order after a commit, the rows behind each output
token's logprobs, and the tree step built from vLLM's batch."""

import contextlib
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from host_reads import no_host_reads, run_as_on_cuda

from triton_ops.testing import random_tree_batch
from triton_ops.tree_metadata import build_tree_metadata
from vllm_tfm.vllm_glue.runner import _build_step
from vllm_tfm.vllm_glue.tree_step import TreeStep
from vllm_tfm.vllm_glue.verify import _path_logprobs, node_logits

# Drafted trees have one root (no forests).
SHAPES = ("chain", "star", "bushy", "random")


def drafted_trees(gen, batch: int, max_nodes: int):
    shapes = [SHAPES[int(i)] for i in torch.randint(len(SHAPES), (batch,), generator=gen)]
    parents, num_nodes = random_tree_batch(gen, shapes, max_nodes)
    return build_tree_metadata(parents, num_nodes, conv_width=4)


def path_of(meta, b: int, leaf: int) -> list[int]:
    """Root-to-leaf node indices, by walking parents."""
    path = [leaf]
    while meta.parents[b, path[-1]] >= 0:
        path.append(int(meta.parents[b, path[-1]]))
    return path[::-1]


def random_leaves(gen, meta) -> torch.Tensor:
    draw = torch.rand(meta.batch_size, generator=gen)
    return (draw * meta.num_nodes.double()).long().clamp(max=meta.num_nodes.long() - 1)


@pytest.mark.parametrize("batch, max_nodes", [(1, 1), (3, 5), (6, 17)])
def test_node_logits_are_each_requests_last_rows(gen, batch, max_nodes):
    meta = drafted_trees(gen, batch, max_nodes)
    counts = meta.num_nodes.long()
    # vLLM's logits rows: each request's sampled rows end at cu_num_sampled_tokens.
    cu = torch.cumsum(counts, 0)
    logits = torch.randn(int(cu[-1]), 11, generator=gen)
    logits[:, 3] = float("-inf")  # a token a grammar masks: no NaN in the padding
    width = max_nodes + 2  # the trees' N: every tree of the step may be smaller
    got = node_logits(logits, cu, meta.num_nodes, width)
    assert got.shape == (batch, width, 11)
    for b in range(batch):
        start = int(cu[b] - counts[b])
        for j in range(width):
            expected = logits[start + j] if j < counts[b] else torch.zeros(11)
            assert torch.equal(got[b, j], expected), (b, j)


@pytest.mark.parametrize("kernel", [True, False], ids=["triton", "torch"])
@pytest.mark.parametrize("batch, max_nodes, prompt_rows",
                         [(1, 1, 0), (2, 4, 0), (4, 9, 3), (5, 16, 7), (3, 65, 2), (2, 70, 5)])
def test_context_order_puts_the_accepted_path_first(gen, batch, max_nodes, prompt_rows, kernel,
                                                     monkeypatch):
    meta = drafted_trees(gen, batch, max_nodes)
    counts = meta.num_nodes.tolist()
    # Rows of the flattened batch: a prompt chunk of `prompt_rows` rows first (not a
    # tree), then each request's nodes in order.
    starts = np.cumsum([prompt_rows] + counts)[:-1]
    node = np.arange(max_nodes)
    token_rows = np.where(node < np.array(counts)[:, None], starts[:, None] + node, -1)
    total = prompt_rows + sum(counts)
    step = TreeStep(
        req_ids=[str(b) for b in range(batch)], meta=meta,
        token_rows=torch.from_numpy(token_rows), prefix_lens=torch.zeros(batch, dtype=torch.int32),
        num_scheduled=meta.num_nodes.clone(), linear_positions=torch.arange(total),
        has_trees=True,
    )
    step.accepted_leaf = random_leaves(gen, meta)
    if kernel:
        run_as_on_cuda(monkeypatch)  # the leaf's value check is CPU-only
    with no_host_reads() if kernel else contextlib.nullcontext():
        # On CUDA the drafter's step would wait for the target's.
        order = step.context_order()
    order = order.tolist()
    expected = list(range(total))
    for b in range(batch):
        path = path_of(meta, b, int(step.accepted_leaf[b]))
        rest = [j for j in range(counts[b]) if j not in path]
        for slot, j in enumerate(path + rest):
            expected[starts[b] + slot] = int(starts[b] + j)
    assert order == expected


def test_path_logprobs_read_each_tokens_path_node(gen):
    meta = drafted_trees(gen, 4, 8)
    counts = meta.num_nodes.long()
    cu = torch.cumsum(counts, 0)
    raw = torch.randn(int(cu[-1]), 13, generator=gen)
    leaves = random_leaves(gen, meta)
    width = 8
    path = torch.full((4, width), -1, dtype=torch.long)
    sampled = torch.full((4, width), -1, dtype=torch.int32)
    for b in range(4):
        nodes = path_of(meta, b, int(leaves[b]))
        path[b, : len(nodes)] = torch.tensor(nodes)
        sampled[b, : len(nodes)] = torch.randint(13, (len(nodes),), generator=gen,
                                                 dtype=torch.int32)
    gathered = []
    sampler = SimpleNamespace(
        compute_logprobs=lambda rows: rows.log_softmax(-1),
        gather_logprobs=lambda logprobs, k, tokens: gathered.append((logprobs, tokens)) or k,
    )
    _path_logprobs(sampler, raw, SimpleNamespace(cu_num_sampled_tokens=cu), meta.num_nodes,
                   path, sampled, 2)
    logprobs, tokens = gathered[0]
    for b in range(4):
        start = int(cu[b] - counts[b])
        for k in range(width):
            node = max(int(path[b, k]), 0)  # past the path: a placeholder row vLLM drops
            assert torch.equal(logprobs[b * width + k], raw[start + node].log_softmax(-1))
            assert int(tokens[b * width + k]) == max(int(sampled[b, k]), 0)


def test_build_step_finds_every_node_row_and_prefix(gen):
    """A batch of a prompt chunk (no drafts) and three trees, as vLLM lays it out."""
    meta = drafted_trees(gen, 3, 6)
    parents = {str(b + 1): meta.parents[b, : int(meta.num_nodes[b])].numpy()
               for b in range(3)}
    num_drafts = [0] + [int(n) - 1 for n in meta.num_nodes]
    num_scheduled = np.array([5] + [d + 1 for d in num_drafts[1:]], dtype=np.int32)
    computed = np.array([0, 17, 3, 40])
    query_start = np.concatenate([[0], np.cumsum(num_scheduled)])
    total = int(query_start[-1])
    runner = SimpleNamespace(
        input_batch=SimpleNamespace(num_reqs=4, req_ids=["0", "1", "2", "3"],
                                    num_computed_tokens_cpu=computed),
        drafter=SimpleNamespace(scheduled_parents=lambda req, n: parents[req][:n]),
        query_start_loc=SimpleNamespace(np=query_start),
        positions=torch.arange(total) + 100,
        device=torch.device("cpu"),
        model_config=SimpleNamespace(hf_config=SimpleNamespace(linear_conv_kernel_dim=4)),
    )
    step = _build_step(runner, None, num_scheduled,
                       SimpleNamespace(num_draft_tokens=num_drafts))
    assert step.has_trees and step.req_ids == ["0", "1", "2", "3"]
    # The prompt chunk is a tree of one node: its last scheduled token.
    assert step.token_rows[0].tolist()[:1] == [4]
    for r in range(4):
        nodes = num_drafts[r] + 1
        rows = step.token_rows[r].tolist()
        assert rows[:nodes] == list(range(query_start[r + 1] - nodes, query_start[r + 1]))
        assert all(row == -1 for row in rows[nodes:])
        assert int(step.prefix_lens[r]) == computed[r] + num_scheduled[r] - nodes
        if r:
            assert step.meta.parents[r, :nodes].tolist() == parents[str(r)].tolist()
    assert torch.equal(step.linear_positions, runner.positions)
