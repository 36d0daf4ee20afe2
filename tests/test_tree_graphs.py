"""Tree steps under vLLM's FULL CUDA graphs (tree_graphs.py), their data flow on CPU.

A graph replays the kernels its capture recorded over the buffers they read then, and
writes the tensors it wrote then. Here a "capture" is a forward over the fixed-buffer
step of the padded size, and a "replay" is the same forward again after the real step
was bound, whose results are copied into the capture's tensors (what a replay
rewrites). The layers' outputs of the real requests and the states their commit leaves
must equal the eager path's; the padding requests must read only the null slot / block
and the commit must never write there. Whether the kernels really are graph-safe (no
host sync, fixed addresses) only the GPU can tell: tests/test_gpu_graphs.py.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import triton_ops.utils as utils
from triton_ops.gdn_tree import gdn_tree_commit
from triton_ops.testing import random_tree_batch
from triton_ops.tree_conv import tree_conv1d_commit
from vllm_tfm.options import MAX_BATCH, TfmOptions, budget_for_batch
from vllm_tfm.vllm_glue import tree_step
from vllm_tfm.vllm_glue.attention import tree_attention_rows
from vllm_tfm.vllm_glue.commit import commit_gdn_records
from vllm_tfm.vllm_glue.gdn import tree_gdn_core
from vllm_tfm.vllm_glue.runner import (
    _build_step,
    wrap_determine_batch_execution_and_padding,
    wrap_warmup_and_capture,
)
from vllm_tfm.vllm_glue.tree_graphs import GraphedTreeSteps, budget_rule_for_graphs, graphable
from vllm_tfm.vllm_glue.tree_step import StepSlot

SHAPES = ("chain", "star", "bushy", "random")
H, HV, K, V, WIDTH = 2, 4, 8, 8, 4
CHANNELS = 2 * H * K + HV * V
NULL_SLOT = 0  # vLLM's NULL_BLOCK_ID: the state slot and block of padding requests


def full_tree_step(gen, num_reqs: int, num_nodes: int, prefix_lens: list[int]):
    """vLLM's uniform decode batch of ``num_reqs`` trees of ``num_nodes`` nodes each,
    built by the runner's own step builder."""
    shapes = [SHAPES[int(i)] for i in torch.randint(len(SHAPES), (num_reqs,), generator=gen)]
    parents, _ = random_tree_batch(gen, shapes, num_nodes, num_nodes=[num_nodes] * num_reqs)
    req_ids = [f"r{r}" for r in range(num_reqs)]
    scheduled = np.full(num_reqs, num_nodes, dtype=np.int32)
    runner = SimpleNamespace(
        input_batch=SimpleNamespace(num_reqs=num_reqs, req_ids=req_ids,
                                    num_computed_tokens_cpu=np.asarray(prefix_lens)),
        drafter=SimpleNamespace(
            scheduled_parents=lambda req, n: parents[req_ids.index(req), :n].numpy()),
        query_start_loc=SimpleNamespace(np=np.arange(num_reqs + 1) * num_nodes),
        positions=torch.arange(num_reqs * num_nodes),
        device=torch.device("cpu"),
        model_config=SimpleNamespace(hf_config=SimpleNamespace(linear_conv_kernel_dim=WIDTH)),
    )
    drafts = SimpleNamespace(num_draft_tokens=[num_nodes - 1] * num_reqs)
    return _build_step(runner, None, scheduled, drafts)


def fake_gdn_layer(gen) -> SimpleNamespace:
    return SimpleNamespace(
        prefix="model.layers.0.linear_attn", activation="silu", head_k_dim=K, head_v_dim=V,
        key_dim=H * K, value_dim=HV * V, tp_size=1,
        conv1d=SimpleNamespace(bias=torch.randn(CHANNELS, generator=gen) * 0.1),
        A_log=torch.randn(HV, generator=gen) * 0.5, dt_bias=torch.randn(HV, generator=gen),
    )


def spec_nodes(step):
    return step.spec_nodes(torch.ones(len(step.req_ids), dtype=torch.bool))


def gdn_forward(gen_or_inputs, layer, step, slots, conv_weight, conv_state, ssm_state):
    qkv, b, a = gen_or_inputs
    return tree_gdn_core(layer, step, spec_nodes(step), qkv, b, a, conv_weight, conv_state,
                         ssm_state, slots)


def rewrite_like_a_replay(captured, replayed) -> None:
    """What a graph replay does to the tensors its capture wrote: new values in place."""
    out, new = captured.verify_out, replayed.verify_out
    assert out.o is None and new.o is None  # records keep what the commit reads, no outputs
    for name in ("delta", "gate_sum", "k_normed"):
        getattr(out, name).copy_(getattr(new, name))
    captured.conv_inputs.copy_(replayed.conv_inputs)
    captured.slots.copy_(replayed.slots)


@pytest.mark.parametrize("num_reqs, padded, num_nodes", [(1, 1, 5), (3, 4, 9), (2, 6, 17)])
def test_a_bound_step_scores_and_commits_as_the_eager_step(gen, num_reqs, padded, num_nodes):
    seed = int(torch.randint(1 << 30, (1,), generator=gen))
    print(f"seed {seed}")
    gen = torch.Generator().manual_seed(seed)
    layer = fake_gdn_layer(gen)
    conv_weight = torch.randn(CHANNELS, WIDTH, generator=gen) * 0.3
    num_slots = padded + 3
    conv_state = torch.randn(num_slots, CHANNELS, WIDTH - 1, generator=gen)
    ssm_state = torch.randn(num_slots, HV, K, V, generator=gen) * 0.1
    real_slots = torch.randperm(num_slots - 1, generator=gen)[:num_reqs] + 1
    rows = padded * num_nodes

    def inputs(count):
        return (torch.randn(count, CHANNELS, generator=gen),
                torch.randn(count, HV, generator=gen), torch.randn(count, HV, generator=gen))

    graphs = GraphedTreeSteps(num_nodes, WIDTH, torch.device("cpu"))
    captured_step = graphs.for_capture(rows)
    assert graphs.for_capture(rows) is captured_step  # one per size, kept
    pad_slots = torch.full((padded,), NULL_SLOT)
    # The engine's caches: the graph reads and commits the ones it was captured over.
    graph_conv, graph_ssm = conv_state.clone(), ssm_state.clone()
    # Capture: vLLM's dummy batch, every slot the null one (verification writes nothing).
    capture_inputs = inputs(rows)
    gdn_forward(capture_inputs, layer, captured_step, pad_slots, conv_weight, graph_conv,
                graph_ssm)
    captured = captured_step.gdn_records[layer.prefix]
    # Full trees from row 0: the graph reads the layer's rows in place, gathering nothing;
    # the commit record keeps its own copy of the conv inputs.
    assert captured_step.tree_nodes.dense_start == 0
    assert torch.equal(captured.conv_inputs.flatten(0, 1), capture_inputs[0])
    assert captured.conv_inputs.data_ptr() != capture_inputs[0].data_ptr()

    step = full_tree_step(gen, num_reqs, num_nodes, prefix_lens=[7, 0, 30, 2, 5, 11][:num_reqs])
    assert graphable(step, num_nodes)
    graphs.bind(step, padded)
    assert torch.equal(captured_step.meta.parents[:num_reqs], step.meta.parents)
    assert torch.equal(captured_step.prefix_lens[:num_reqs], step.prefix_lens)

    # Replay: the real rows first, stale inputs in the padding rows.
    real = inputs(num_reqs * num_nodes)
    stale = inputs(rows - num_reqs * num_nodes)
    padded_inputs = tuple(torch.cat([r, s]) for r, s in zip(real, stale))
    graph_slots = pad_slots.clone()
    graph_slots[:num_reqs] = real_slots
    replayed_out = gdn_forward(padded_inputs, layer, captured_step, graph_slots, conv_weight,
                               graph_conv, graph_ssm)
    rewrite_like_a_replay(captured, captured_step.gdn_records[layer.prefix])

    eager_conv, eager_ssm = conv_state.clone(), ssm_state.clone()
    eager = _eager_copy(step)
    eager_out = gdn_forward(real, layer, eager, real_slots, conv_weight, eager_conv, eager_ssm)
    assert torch.allclose(replayed_out[: num_reqs * num_nodes], eager_out, atol=1e-6, rtol=1e-5)

    leaf = torch.randint(num_nodes, (num_reqs,), generator=gen)
    # The bound step commits over its graph's buffers (the leaves copied into them).
    step.accepted_leaf = leaf.clone()
    committed = []

    def commit(fixed):
        committed.append(fixed)
        commit_gdn_records(fixed.gdn_records.values(), fixed.accepted_leaf)

    graphs.commit(step, commit)
    assert len(committed) == 1 and torch.equal(committed[0].accepted_leaf, leaf)
    assert committed[0].accepted_leaf.data_ptr() != step.accepted_leaf.data_ptr()
    assert committed[0].meta.parents.data_ptr() == captured_step.meta.parents.data_ptr()
    commit_gdn_records(eager.gdn_records.values(), leaf)
    assert torch.allclose(graph_ssm, eager_ssm, atol=1e-6, rtol=1e-5)
    assert torch.allclose(graph_conv, eager_conv, atol=1e-6, rtol=1e-5)
    # Nothing reached the null slot, nor any slot but the real requests'.
    untouched = torch.ones(num_slots, dtype=torch.bool)
    untouched[real_slots] = False
    assert torch.equal(graph_ssm[untouched], ssm_state[untouched])
    assert torch.equal(graph_conv[untouched], conv_state[untouched])


def test_each_capture_forward_makes_its_own_state_slots():
    """vLLM runs eager warm-up forwards over the kept capture step, then the captured one.
    The captured forward must make its own int64 copy of the slot table, which every replay
    redoes: a warm-up's copy, reused, would hold the warm-up's slots in every replay (every
    FULL-graph tree step then read other requests' GDN states: the H100, 2026-12-06)."""
    graphs = GraphedTreeSteps(4, WIDTH, torch.device("cpu"))
    table = torch.tensor([[3, 0], [5, 0]], dtype=torch.int32)
    warm_up = graphs.for_capture(8).state_slots(table, 2)
    table[:, 0] = torch.tensor([7, 2], dtype=torch.int32)
    captured = graphs.for_capture(8).state_slots(table, 2)
    assert captured is not warm_up and captured.tolist() == [7, 2]


def test_a_capture_never_reuses_state_slots_made_before_it(monkeypatch):
    """V1 runs its warm-ups and the capture over one step, with no new_forward between
    them: inside a capture, state_slots makes its own copy (for the graph to record) even
    when a warm-up made one from the same table; within the capture it is made once."""
    step = GraphedTreeSteps(4, WIDTH, torch.device("cpu")).for_capture(8)
    table = torch.tensor([[3, 0], [5, 0]], dtype=torch.int32)
    warm_up = step.state_slots(table, 2)
    assert step.state_slots(table, 2) is warm_up
    monkeypatch.setattr(tree_step, "capturing_graph", lambda device: True)
    captured = step.state_slots(table, 2)
    assert captured is not warm_up and captured.tolist() == [3, 5]
    assert step.state_slots(table, 2) is captured


def test_a_table_a_graph_captured_outlives_the_cache(monkeypatch):
    """A captured commit reads its layer table's address at every replay: eager steps over
    fresh tensors that make more tables than the cache holds must not free it (on the H100
    they did, and the replayed commit read garbage offsets); a capture may not make one."""
    monkeypatch.setattr(utils, "_DEVICE_TABLES", OrderedDict())
    monkeypatch.setattr(utils, "_GRAPH_TABLES", {})
    monkeypatch.setattr(utils, "_MAX_DEVICE_TABLES", 2)
    cpu = torch.device("cpu")
    captured_rows = [[0, 0], [96, 40]]
    eager = utils.device_table(captured_rows, cpu)  # the commit before the capture
    monkeypatch.setattr(utils, "capturing_graph", lambda device: True)
    graph_table = utils.device_table(captured_rows, cpu)
    assert graph_table is eager
    with pytest.raises(RuntimeError, match="capture does not allow"):
        utils.device_table([[0, 0], [1, 1]], cpu)
    monkeypatch.setattr(utils, "capturing_graph", lambda device: False)
    for offset in range(1, 6):  # eager steps, each over tensors at new offsets
        assert utils.device_table([[0, 0], [offset, offset]], cpu).tolist() == [[0, 0], [offset, offset]]
    assert len(utils._DEVICE_TABLES) == 2
    assert utils.device_table(captured_rows, cpu) is graph_table
    assert graph_table.tolist() == captured_rows


def test_a_steps_gdn_layers_commit_in_one_launch_as_each_alone(gen, monkeypatch):
    """commit_gdn_records on the Triton path (interpreted): a step's GDN layers, their
    caches views of one buffer (vLLM shares cache tensors across layers) or apart and
    slots of their own, commit in one launch per state kind as each layer's own commits
    would, bit for bit; the tables of that launch are made once."""
    num_reqs, num_nodes, num_slots, layers = 3, 9, 6, 3
    step = full_tree_step(gen, num_reqs, num_nodes, prefix_lens=[4, 0, 12])
    conv_buffer = torch.randn(layers - 1, num_slots, CHANNELS, WIDTH - 1, generator=gen)
    ssm_buffer = torch.randn(layers - 1, num_slots, HV, K, V, generator=gen) * 0.1
    conv_states = [*conv_buffer, torch.randn(num_slots, CHANNELS, WIDTH - 1, generator=gen)]
    ssm_states = [*ssm_buffer, torch.randn(num_slots, HV, K, V, generator=gen) * 0.1]
    slots = torch.randperm(num_slots - 1, generator=gen)[:num_reqs] + 1
    for index, (conv_state, ssm_state) in enumerate(zip(conv_states, ssm_states)):
        layer = fake_gdn_layer(gen)
        layer.prefix = f"model.layers.{index}.linear_attn"
        inputs = (torch.randn(num_reqs * num_nodes, CHANNELS, generator=gen),
                  torch.randn(num_reqs * num_nodes, HV, generator=gen),
                  torch.randn(num_reqs * num_nodes, HV, generator=gen))
        gdn_forward(inputs, layer, step, slots.clone(), torch.randn(CHANNELS, WIDTH, generator=gen),
                    conv_state, ssm_state)
    leaf = torch.tensor([num_nodes - 1, -1, 3])
    want_conv = [state.clone() for state in conv_states]
    want_ssm = [state.clone() for state in ssm_states]
    for record, conv_state, ssm_state in zip(step.gdn_records.values(), want_conv, want_ssm):
        gdn_tree_commit(ssm_state, record.slots, record.meta, record.verify_out, leaf,
                        backend="triton")
        tree_conv1d_commit(conv_state, record.slots, record.conv_inputs, record.meta, leaf,
                           backend="triton")
    monkeypatch.setattr(utils, "_DEVICE_TABLES", OrderedDict())
    commit_gdn_records(step.gdn_records.values(), leaf, backend="triton")
    # One table for the recurrent states, one for the conv states, each over every layer.
    assert [table.shape for table in utils._DEVICE_TABLES.values()] == [(layers, 5), (layers, 3)]
    for got, want in zip((*conv_states, *ssm_states), (*want_conv, *want_ssm)):
        assert torch.equal(got, want)


def _eager_copy(step):
    """The same step, unbound: its own records (the eager path)."""
    return dataclasses.replace(step, gdn_records={}, _spec_nodes={})


@pytest.mark.parametrize("num_reqs, padded, num_nodes", [(1, 2, 5), (3, 4, 9)])
def test_a_bound_step_attends_as_the_eager_step(gen, num_reqs, padded, num_nodes):
    seed = int(torch.randint(1 << 30, (1,), generator=gen))
    print(f"seed {seed}")
    gen = torch.Generator().manual_seed(seed)
    heads, kv_heads, dim, block_size, blocks_per_req = 4, 2, 16, 8, 6
    num_blocks = 1 + padded * blocks_per_req
    keys = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
    values = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
    impl = SimpleNamespace(scale=dim ** -0.5, sliding_window=None, logits_soft_cap=0)
    graphs = GraphedTreeSteps(num_nodes, WIDTH, torch.device("cpu"))
    captured_step = graphs.for_capture(padded * num_nodes)
    step = full_tree_step(gen, num_reqs, num_nodes, prefix_lens=[9, 0, 21][:num_reqs])
    graphs.bind(step, padded)
    # vLLM's block table: the real requests' blocks, the null block for the padding.
    table = torch.full((padded, blocks_per_req), NULL_SLOT, dtype=torch.int32)
    table[:num_reqs] = 1 + torch.randperm(num_blocks - 1, generator=gen)[
        : num_reqs * blocks_per_req].view(num_reqs, blocks_per_req).int()
    query = torch.randn(padded * num_nodes, heads, dim, generator=gen)
    graph_out = torch.full_like(query, float("nan"))
    tree_attention_rows(captured_step, impl, query, (keys, values), table, graph_out)
    real_rows = num_reqs * num_nodes
    eager_out = torch.full_like(query[:real_rows], float("nan"))
    tree_attention_rows(_eager_copy(step), impl, query[:real_rows], (keys, values),
                        table[:num_reqs], eager_out)
    assert not eager_out.isnan().any()
    assert torch.allclose(graph_out[:real_rows], eager_out, atol=1e-6, rtol=1e-5)


def _runner(step, data_parallel=1, captured=(2,), num_nodes=5):
    graphs = GraphedTreeSteps(num_nodes, WIDTH, torch.device("cpu"))
    for num_reqs in captured:
        graphs.for_capture(num_reqs * num_nodes)
    return SimpleNamespace(_tfm_options=object(), _tfm_step=step, _tfm_graphs=graphs,
                           _tfm_slot=StepSlot(),
                           parallel_config=SimpleNamespace(data_parallel_size=data_parallel))


def _dispatch(runner, mode_name: str, num_reqs: int):
    """(force_eager flags of each call of vLLM's method, the result returned)."""
    from vllm.config import CUDAGraphMode

    calls = []

    def original(self, num_tokens, **kwargs):
        calls.append(kwargs.get("force_eager", False))
        mode = CUDAGraphMode.NONE if kwargs.get("force_eager") else CUDAGraphMode[mode_name]
        return mode, SimpleNamespace(num_reqs=num_reqs, num_tokens=num_reqs * 5)

    result = wrap_determine_batch_execution_and_padding(original)(runner, 10)
    return calls, result[0].name


@pytest.mark.parametrize(
    "mode, num_reqs, data_parallel, calls, replayed",
    [
        ("FULL", 2, 1, [False], "FULL"),  # a captured size: the graph, step bound
        ("FULL", 4, 1, [False, True], "NONE"),  # a size captured without a tree step
        ("PIECEWISE", 2, 1, [False, True], "NONE"),  # pieces run the chain kernels
        ("FULL", 2, 2, [True], "NONE"),  # data parallel: one dispatch, eager
    ],
)
def test_full_trees_replay_only_graphs_captured_with_a_tree_step(
        gen, mode, num_reqs, data_parallel, calls, replayed):
    step = full_tree_step(gen, 2, 5, prefix_lens=[3, 4])
    runner = _runner(step, data_parallel)
    chains = runner._tfm_graphs.steps[2].meta.parents.clone()
    got_calls, got_mode = _dispatch(runner, mode, num_reqs)
    assert (got_calls, got_mode) == (calls, replayed)
    # Only a replayed graph's buffers receive the step's trees.
    expected = step.meta.parents if replayed == "FULL" else chains
    assert torch.equal(runner._tfm_graphs.steps[2].meta.parents, expected)


def test_steps_that_are_not_uniform_full_trees_run_eagerly(gen):
    smaller = full_tree_step(gen, 2, 4, prefix_lens=[3, 4])  # 3 drafts, not 4
    assert not graphable(smaller, 5)
    calls, mode = _dispatch(_runner(smaller), "FULL", 2)
    assert (calls, mode) == ([True], "NONE")
    lost = dataclasses.replace(full_tree_step(gen, 2, 5, prefix_lens=[3, 4]),
                               void=torch.tensor([True, False]))
    assert not graphable(lost, 5)


def test_full_decode_graphs_are_captured_with_their_tree_step(gen):
    from vllm.config import CUDAGraphMode

    held = full_tree_step(gen, 1, 5, prefix_lens=[0])
    runner = _runner(held, captured=())
    seen = []

    def original(self, desc, mode, *args, **kwargs):
        seen.append((self._tfm_slot.step, self._tfm_step))

    wrapped = wrap_warmup_and_capture(original)
    wrapped(runner, SimpleNamespace(uniform=True, num_tokens=15), CUDAGraphMode.FULL)
    wrapped(runner, SimpleNamespace(uniform=False, num_tokens=15), CUDAGraphMode.FULL)
    wrapped(runner, SimpleNamespace(uniform=True, num_tokens=15), CUDAGraphMode.PIECEWISE)
    capture_step = runner._tfm_graphs.steps[3]
    assert seen == [(capture_step, None), (None, held), (None, held)]
    assert runner._tfm_slot.step is None and runner._tfm_step is held
    with pytest.raises(RuntimeError, match="not a multiple of 1 \\+ num_speculative_tokens"):
        wrapped(runner, SimpleNamespace(uniform=True, num_tokens=16), CUDAGraphMode.FULL)


def test_full_decode_graphs_pin_the_default_budget_rule_only():
    default = TfmOptions(budget=64, tree="ddtree")
    assert [default.step_budget(b) for b in (1, 2, 3)] == [64, 32, 16]  # the cost model
    pinned = budget_rule_for_graphs(default, full_decode_graphs=True)
    assert pinned.budget_by_batch == ((MAX_BATCH, 64),)
    assert {pinned.step_budget(b) for b in (1, 2, 3, 8, 256)} == {64}
    # Without FULL decode graphs, or with a table the user chose, nothing changes.
    assert budget_rule_for_graphs(default, full_decode_graphs=False) is default
    chosen = TfmOptions(budget=64, tree="ddtree", budget_by_batch=((2, 64), (MAX_BATCH, 32)))
    assert budget_rule_for_graphs(chosen, full_decode_graphs=True) is chosen
    assert budget_for_batch(chosen.budget_table, 3) == 32


@pytest.mark.parametrize("tp_size", [1, 2])
def test_split_qkv_views_vllms_rearranged_qkv(gen, tp_size):
    """The tree path's q / k / v views hold what vLLM's own ``rearrange_mixed_qkv`` copies
    out (called on a stand-in layer: it reads only these sizes)."""
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
        QwenGatedDeltaNetAttention,
    )

    from vllm_tfm.vllm_glue.gdn import split_qkv

    layer = SimpleNamespace(key_dim=4 * 16, value_dim=8 * 32, tp_size=tp_size, head_k_dim=16,
                            head_v_dim=32)
    R, N = 3, 5
    y = torch.randn(R, N, (2 * layer.key_dim + layer.value_dim) // tp_size, generator=gen)
    want = QwenGatedDeltaNetAttention.rearrange_mixed_qkv(layer, y.reshape(R * N, -1))
    for got, ref in zip(split_qkv(layer, y), want):
        assert got.untyped_storage().data_ptr() == y.untyped_storage().data_ptr()  # no copy
        assert torch.equal(got, ref.reshape(got.shape))
