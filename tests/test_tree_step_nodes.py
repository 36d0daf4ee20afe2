"""The per-step node indices the layers read (tree_step.RequestNodes): built once per step
from host data, they move the same rows as the per-layer boolean-mask gathers they
replaced, and a GDN metadata's spec subset is indexed once per step."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from triton_ops.testing import random_tree_batch
from triton_ops.tree_metadata import build_tree_metadata
from vllm_tfm.vllm_glue.runner import _apply_tree_positions, _build_step
from vllm_tfm.vllm_glue.tree_step import select_requests

SHAPES = ("chain", "star", "bushy", "random")


def mixed_step(gen, num_drafts: list[int], prompt_rows: int):
    """A step of vLLM's layout: a prompt chunk of ``prompt_rows`` tokens first (none for
    0), then decodes with ``num_drafts`` drafts each (0: a decode without drafts)."""
    trees = [d for d in num_drafts if d > 0]
    shapes = [SHAPES[int(i)] for i in torch.randint(len(SHAPES), (len(trees),), generator=gen)]
    parents_batch, _ = random_tree_batch(gen, shapes, max(trees) + 1,
                                         num_nodes=[d + 1 for d in trees])
    first = 1 if prompt_rows else 0
    parents, t = {}, 0
    for r, drafts in enumerate(num_drafts, start=first):
        if drafts:
            parents[str(r)] = parents_batch[t, : drafts + 1].numpy()
            t += 1
    all_drafts = [0] * first + num_drafts
    req_ids = [str(r) for r in range(len(all_drafts))]
    num_scheduled = np.array([prompt_rows] * first + [d + 1 for d in num_drafts],
                             dtype=np.int32)
    query_start = np.concatenate([[0], np.cumsum(num_scheduled)])
    total = int(query_start[-1])
    runner = SimpleNamespace(
        input_batch=SimpleNamespace(num_reqs=len(req_ids), req_ids=req_ids,
                                    num_computed_tokens_cpu=np.arange(len(req_ids)) * 7),
        drafter=SimpleNamespace(scheduled_parents=lambda req, n: parents[req][:n]),
        query_start_loc=SimpleNamespace(np=query_start),
        positions=torch.arange(total),
        device=torch.device("cpu"),
        model_config=SimpleNamespace(hf_config=SimpleNamespace(linear_conv_kernel_dim=4)),
    )
    return _build_step(runner, None, num_scheduled, SimpleNamespace(num_draft_tokens=all_drafts))


def masked_to_nodes(flat, rows):
    """The boolean-mask gather the layers did before: [R', N, ...], zeros for padding."""
    valid = rows >= 0
    by_node = flat.new_zeros(*rows.shape, *flat.shape[1:])
    by_node[valid] = flat[rows[valid]]
    return by_node


@pytest.mark.parametrize("num_drafts, prompt_rows, dense_start", [
    ([3, 0, 6, 1], 5, None),  # a prompt chunk, a decode without drafts, trees
    ([4, 4], 1, 1),  # a prompt chunk whose last token alone is scheduled, full trees
    ([2, 7, 3], 0, None),  # trees only, of different sizes
    ([5, 5, 5], 0, 0),  # a decode batch of full trees: what a FULL graph holds
])
def test_tree_nodes_move_the_rows_of_each_tree(gen, num_drafts, prompt_rows, dense_start):
    step = mixed_step(gen, num_drafts, prompt_rows)
    first = 1 if prompt_rows else 0
    trees = [r + first for r, d in enumerate(num_drafts) if d > 0]
    nodes = step.tree_nodes
    assert nodes.requests.tolist() == trees
    assert step.only_tree_rows == (prompt_rows == 0 and 0 not in num_drafts)
    expected_meta = select_requests(step.meta, torch.tensor(trees))
    assert torch.equal(nodes.meta.ancestor_words, expected_meta.ancestor_words)
    assert torch.equal(nodes.prefix_lens, step.prefix_lens[trees])
    total = int(step.linear_positions.numel())
    flat = torch.randn(total, 3, 2, generator=gen)
    rows = step.token_rows[trees]
    by_node = nodes.to_nodes(flat)
    assert torch.equal(by_node, masked_to_nodes(flat, rows))
    # Dense nodes move no data: a view of the flat rows.
    assert nodes.dense_start == dense_start
    assert (by_node.data_ptr() == flat[dense_start or 0].data_ptr()) == (dense_start is not None)
    assert torch.equal(nodes.real_nodes(by_node), flat[nodes.rows])
    # Back to the batch rows: the attention output write.
    out = torch.zeros(total, 3, 2)
    nodes.write_rows(out, by_node)
    reference = torch.zeros(total, 3, 2)
    reference[rows[rows >= 0]] = by_node[rows >= 0]
    assert torch.equal(out, reference)


def test_a_step_without_drafts_has_no_tree_nodes(gen):
    step = mixed_step(gen, [1], 4)
    step_without = _build_step(
        SimpleNamespace(
            input_batch=SimpleNamespace(num_reqs=1, req_ids=["0"],
                                        num_computed_tokens_cpu=np.array([3])),
            drafter=None, query_start_loc=SimpleNamespace(np=np.array([0, 4])),
            positions=torch.arange(4), device=torch.device("cpu"),
            model_config=SimpleNamespace(hf_config=SimpleNamespace(linear_conv_kernel_dim=4)),
        ),
        None, np.array([4], dtype=np.int32), SimpleNamespace(num_draft_tokens=[0]),
    )
    assert step.has_trees and step.tree_nodes is not None
    assert not step_without.has_trees and step_without.tree_nodes is None
    assert step_without.tree_requests().numel() == 0 and not step_without.only_tree_rows


def test_spec_nodes_are_local_to_the_spec_rows_and_built_once(gen):
    num_drafts = [3, 0, 6, 1]
    step = mixed_step(gen, num_drafts, 5)
    # vLLM's GDN metadata: every decode is a spec row (drafts or not), the prompt is not.
    mask = torch.tensor([False, True, True, True, True])
    nodes = step.spec_nodes(mask)
    assert nodes.requests.tolist() == [1, 2, 3, 4]
    counts = [d + 1 for d in num_drafts]
    starts = np.cumsum([0] + counts)[:-1]
    spec_rows = torch.randn(sum(counts), 4, generator=gen)
    node = np.arange(step.meta.max_nodes)
    local = np.where(node < np.array(counts)[:, None], starts[:, None] + node, -1)
    assert torch.equal(nodes.to_nodes(spec_rows),
                       masked_to_nodes(spec_rows, torch.from_numpy(local)))
    assert torch.equal(nodes.real_nodes(nodes.to_nodes(spec_rows)), spec_rows)
    assert step.spec_nodes(mask.clone()) is nodes  # same mask: indexed once
    other = step.spec_nodes(torch.tensor([False, False, True, False, True]))
    assert other.requests.tolist() == [2, 4] and other is not nodes


@pytest.mark.parametrize("num_drafts, prompt_rows", [([3, 0, 6, 1], 5), ([2, 7, 3], 0)])
def test_tree_positions_are_prefix_plus_depth(gen, num_drafts, prompt_rows):
    step = mixed_step(gen, num_drafts, prompt_rows)
    total = int(step.linear_positions.numel())
    mrope = SimpleNamespace(gpu=torch.arange(total).repeat(3, 1))
    runner = SimpleNamespace(positions=torch.arange(total) + 1000, uses_mrope=True,
                             mrope_positions=mrope)
    _apply_tree_positions(runner, step)
    expected = torch.arange(total) + 1000
    for r in range(len(step.req_ids)):
        count = int(step.num_nodes_host[r])
        for j in range(count):
            row = int(step.token_rows[r, j])
            expected[row] = row - j + int(step.meta.depths[r, j]) + 1000
    assert torch.equal(runner.positions, expected)
    assert torch.equal(runner.mrope_positions.gpu, (expected - 1000).repeat(3, 1))


@pytest.mark.parametrize("num_nodes, out_dtype", [
    ([5, 5], torch.bfloat16),  # full trees end to end: the verify writes vLLM's rows
    ([5, 5], torch.float32),  # a buffer of another dtype: copied
    ([5, 3], torch.bfloat16),  # ragged trees: copied to the real nodes' rows
])
def test_gdn_core_writes_its_outputs_into_the_layers_rows(num_nodes, out_dtype, gen, monkeypatch):
    """tree_gdn_core with ``out`` (vLLM's output rows of the spec tokens) gives what it
    returns without: the real nodes' outputs in their rows, nothing written elsewhere; a
    dense step's verify writes the rows themselves (its ``out`` is a view of them). The
    commit record keeps the nodes' inputs in memory of its own, never vLLM's mixed_qkv,
    and no outputs (which would keep vLLM's rows alive)."""
    import triton_ops.gdn_tree as gdn_tree
    from vllm_tfm.vllm_glue.gdn import tree_gdn_core
    from vllm_tfm.vllm_glue.tree_step import request_nodes

    R, N, H, HV, K, V, W = len(num_nodes), max(num_nodes), 1, 2, 16, 16, 4
    parents, counts = random_tree_batch(gen, ["bushy", "chain"], N, num_nodes=num_nodes)
    meta = build_tree_metadata(parents, counts, conv_width=W)
    first_rows = np.concatenate([[0], np.cumsum(num_nodes)[:-1]])
    nodes = request_nodes(meta, torch.tensor([7, 9], dtype=torch.int32), np.arange(R), first_rows,
                          np.array(num_nodes))
    assert (nodes.dense_start is not None) == (num_nodes == [N] * R)
    T, C = sum(num_nodes), 2 * H * K + HV * V
    layer = SimpleNamespace(activation="silu", conv1d=SimpleNamespace(bias=torch.randn(C, generator=gen)),
                            A_log=torch.randn(HV, generator=gen), dt_bias=torch.randn(HV, generator=gen),
                            key_dim=H * K, value_dim=HV * V, tp_size=1, head_k_dim=K, head_v_dim=V,
                            prefix="layers.0")
    mixed_qkv = torch.randn(T, C, generator=gen).bfloat16()
    b, a = (torch.randn(T, HV, generator=gen).bfloat16() for _ in range(2))
    weight = torch.randn(C, W, generator=gen)
    conv_state, ssm_state = torch.randn(4, C, W - 1, generator=gen), torch.randn(4, HV, K, V, generator=gen)
    slots = torch.tensor([2, 0])

    verify = gdn_tree.gdn_tree_verify
    outs = []

    def recording_verify(*args, **kwargs):
        outs.append(kwargs["out"])
        return verify(*args, **kwargs)

    monkeypatch.setattr(gdn_tree, "gdn_tree_verify", recording_verify)

    def core(out=None):
        step = SimpleNamespace(gdn_records={})
        result = tree_gdn_core(layer, step, nodes, mixed_qkv, b, a, weight, conv_state, ssm_state, slots,
                               out=out)
        record = step.gdn_records["layers.0"]
        inputs = record.conv_inputs.flatten(0, 1)[nodes.slots]
        assert torch.equal(inputs, mixed_qkv[nodes.rows])
        assert record.conv_inputs.untyped_storage().data_ptr() != mixed_qkv.untyped_storage().data_ptr()
        assert record.verify_out.o is None
        return result, outs[-1]

    expected, _ = core()
    rows = torch.full((T + 2, HV, V), float("nan"), dtype=out_dtype)
    out, o = core(rows[:T])
    assert out.data_ptr() == rows.data_ptr()
    assert torch.equal(out[nodes.rows], expected.to(out_dtype))
    assert rows[T:].isnan().all()
    direct = nodes.dense_start is not None and out_dtype == torch.bfloat16
    assert (o is not None and o.data_ptr() == rows.data_ptr()) == direct


def test_record_buffers_are_kept_only_from_graph_captures(monkeypatch):
    """Commit-record buffers: a capture makes (or grows) the layer's buffer and later
    steps that fit get views of it; outside a capture a step that does not fit gets a new
    tensor and the buffer stays; a buffer a capture wrote is kept when a larger capture
    outgrows it (its graph replays over that address)."""
    import triton_ops.utils as utils
    from vllm_tfm.vllm_glue.gdn import RecordBuffers

    capturing = [False]
    monkeypatch.setattr(utils, "capturing_graph", lambda device: capturing[0])
    buffers, cpu = RecordBuffers(), torch.device("cpu")

    def take(shape, dtype=torch.float32):
        return buffers.take("delta", shape, dtype, cpu)

    first, second = take((2, 3)), take((2, 3))
    assert first.data_ptr() != second.data_ptr()  # no capture yet: nothing kept
    capturing[0] = True
    captured = take((4, 5))
    capturing[0] = False
    smaller, same = take((2, 3)), take((4, 5))
    assert smaller.data_ptr() == same.data_ptr() == captured.data_ptr()
    assert smaller.shape == (2, 3) and smaller.is_contiguous()
    wider = take((5, 5))  # outgrows it outside a capture: a new tensor, the buffer stays
    assert wider.data_ptr() != captured.data_ptr() and take((4, 5)).data_ptr() == captured.data_ptr()
    assert take((2, 3), torch.float64).data_ptr() != captured.data_ptr()  # another dtype
    capturing[0] = True
    grown = take((6, 5))
    capturing[0] = False
    assert take((6, 5)).data_ptr() == grown.data_ptr() != captured.data_ptr()
    assert any(kept.data_ptr() == captured.data_ptr() for kept in buffers._outgrown)


def test_state_slots_are_made_once_per_slot_table(gen):
    """Every GDN layer of a KV-cache group passes its group's slot table: column 0 as int64,
    made once per table and step (one launch per group, not per layer)."""
    step = mixed_step(gen, [2, 3], 0)
    table_a = torch.tensor([[4, 9], [1, 8], [6, 7]], dtype=torch.int32)
    table_b = table_a.clone()
    slots = step.state_slots(table_a, 2)
    assert slots.dtype == torch.int64 and slots.tolist() == [4, 1]
    assert step.state_slots(table_a, 2) is slots
    assert step.state_slots(table_b, 2) is not slots and step.state_slots(table_a, 3).tolist() == [4, 1, 6]
