"""Model runner V2 glue (vllm_glue/v2) on CPU: the runner choice, trees by request slot,
the tree step of a V2 batch, its verification and request refusals. The V2 classes that
need vLLM 0.33's GPU runner (TreeModelState, TreeSpeculator) run on the H200 only
(tools/gpu_vllm/run_v2_tree.sh)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_tfm.drafting.draft_round import candidate_pools, draft_trees
from vllm_tfm.drafting.verifiers import verify_greedy
from vllm_tfm.vllm_glue.v2 import choice
from vllm_tfm.vllm_glue.v2.trees import (
    SlotTrees,
    apply_tree_positions,
    batch_tree_step,
    restore_linear_positions,
)
from vllm_tfm.vllm_glue.v2.verify import (
    refused_sampling_field,
    sampled_tokens,
    verify_batch,
)
from vllm_tfm.vllm_glue.verify import node_logits

VOCAB, DEPTH, POOL, BUDGET = 40, 3, 4, 5


def _trees(seed: int, rows: int, tree: str = "ddtree"):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, DEPTH, VOCAB, generator=generator)
    roots = torch.randint(0, VOCAB, (rows,), generator=generator)
    return draft_trees(tree, roots, candidate_pools(logits, POOL), BUDGET, validate=True)


@pytest.mark.parametrize("env, on_cuda, version, tp, expected", [
    (None, True, (0, 33), 1, choice.DEFAULT_TREE_RUNNER),
    ("", True, (0, 33), 1, choice.DEFAULT_TREE_RUNNER),
    (None, True, (0, 32), 1, "v1"),
    (None, False, (0, 33), 1, "v1"),
    ("0", True, (0, 33), 1, "v1"),
    ("1", True, (0, 33), 1, "v2"),
])
def test_tree_runner_choice(env, on_cuda, version, tp, expected):
    assert choice.tree_runner(env, on_cuda, version, tp) == expected


@pytest.mark.parametrize("on_cuda, version, tp, words", [
    (False, (0, 33), 1, "CUDA"), (True, (0, 32), 1, ">= 0.33"),
    (True, (0, 33), 2, "tensor_parallel_size"),
])
def test_v2_is_refused_where_it_cannot_run(on_cuda, version, tp, words):
    with pytest.raises(ValueError, match="VLLM_USE_V2_MODEL_RUNNER=1") as error:
        choice.tree_runner("1", on_cuda, version, tp)
    assert words in str(error.value)


def test_an_unknown_runner_value_names_the_allowed_ones():
    with pytest.raises(ValueError, match=r"\['0', '1'\]"):
        choice.tree_runner("true", True, (0, 33), 1)


def test_slot_trees_keep_each_slots_tree_and_pad_it_under_the_root():
    seed = 11
    print("seed", seed)
    trees = _trees(seed, 3)
    # Cut one tree short: its padding nodes repeat the root and hang under it.
    node = torch.arange(trees.max_nodes)
    trees = trees.truncate(torch.tensor([BUDGET + 1, 2, 4]))
    slots_store = SlotTrees.allocate(6, BUDGET + 1, BUDGET, torch.device("cpu"))
    slots = torch.tensor([4, 0, 2])
    slots_store.store(slots, trees)
    back = slots_store.gather(slots)
    for name in ("tokens", "parents", "depths", "num_nodes", "draft_logq"):
        assert torch.equal(getattr(back, name), getattr(trees, name)), name
    # Cut to the nodes a step scored, in the gather: as truncate cuts the gathered trees.
    scored = torch.tensor([3, 5, 1])
    cut, truncated = slots_store.gather(slots, num_nodes=scored), back.truncate(scored)
    for name in ("tokens", "parents", "depths", "num_nodes", "draft_logq"):
        assert torch.equal(getattr(cut, name), getattr(truncated, name)), name
    drafts = slots_store.draft_tokens(slots, BUDGET)
    real = node[1:] < trees.num_nodes.view(-1, 1)
    assert torch.equal(torch.where(real, drafts, -1), torch.where(real, trees.tokens[:, 1:], -1))
    assert torch.equal(drafts[~real], trees.tokens[:, :1].expand_as(drafts)[~real])
    parents = slots_store.kernel_parents(slots)
    assert parents[:, 0].eq(-1).all()
    assert torch.equal(parents[~torch.cat([torch.ones(3, 1, dtype=torch.bool), real], 1)],
                       torch.zeros(int((~real).sum()), dtype=torch.int64))
    # Slots never drafted for, and slots given to a new request, are roots alone.
    slots_store.clear(4)
    assert slots_store.gather(torch.tensor([1, 4])).num_nodes.tolist() == [1, 1]
    assert slots_store.kernel_parents(torch.tensor([4]))[0, 1:].eq(0).all()


def test_slot_trees_refuse_trees_wider_than_the_slots():
    store = SlotTrees.allocate(2, BUDGET, BUDGET, torch.device("cpu"))
    with pytest.raises(ValueError, match="do not fit"):
        store.store(torch.tensor([0]), _trees(1, 1))


def _batch(trees: SlotTrees, positions: torch.Tensor):
    """A V2 InputBatch of 3 requests: decodes of 6 and 3 nodes (slots 4, 0), then a
    prompt chunk of 4 tokens (slot 2), with 10, 7 and 0 tokens computed before."""
    scheduled = np.array([6, 3, 4])
    return SimpleNamespace(
        num_reqs=3, num_draft_tokens=7, num_draft_tokens_per_req=np.array([5, 2, 0]),
        idx_mapping=torch.tensor([4, 0, 2]), num_scheduled_tokens=scheduled,
        seq_lens=torch.tensor([16, 10, 4], dtype=torch.int32),
        query_start_loc_np=np.concatenate([[0], np.cumsum(scheduled)]),
        req_ids=["a", "b", "c"], positions=positions,
    )


def test_batch_tree_step_rows_prefixes_and_positions():
    seed = 5
    print("seed", seed)
    store = SlotTrees.allocate(6, BUDGET + 1, BUDGET, torch.device("cpu"))
    trees = _trees(seed, 3)
    store.store(torch.tensor([4, 0, 2]), trees)
    linear = torch.cat([torch.arange(10, 16), torch.arange(7, 10), torch.arange(0, 4)])
    positions = torch.cat([linear, torch.full((3,), -7)])  # padding rows past the batch
    batch = _batch(store, positions)
    step = batch_tree_step(batch, store, conv_width=4)
    assert step.token_rows.tolist() == [[0, 1, 2, 3, 4, 5], [6, 7, 8, -1, -1, -1],
                                        [12, -1, -1, -1, -1, -1]]
    assert step.prefix_lens.tolist() == [10, 7, 3]
    assert step.tree_nodes.requests.tolist() == [0, 1] and not step.only_tree_rows
    apply_tree_positions(positions, step)
    depths = store.gather(torch.tensor([4, 0])).depths
    assert positions[:6].tolist() == (10 + depths[0]).tolist()
    assert positions[6:9].tolist() == (7 + depths[1, :3]).tolist()
    assert positions[9:].tolist() == [0, 1, 2, 3, -7, -7, -7]
    restore_linear_positions(positions, step)
    assert torch.equal(positions[:13], linear)


@pytest.mark.parametrize("num_draft_tokens_per_req", [None, np.array([0, 0])])
def test_a_batch_without_drafts_has_a_tree_step_of_roots_only_when_asked(
        num_draft_tokens_per_req):
    """V2 runs decodes without drafts as GDN spec rows: TreeModelState asks for a step of
    one-node trees then (each row its request's root, at its linear position)."""
    store = SlotTrees.allocate(3, BUDGET + 1, BUDGET, torch.device("cpu"))
    store.store(torch.tensor([2, 0]), _trees(3, 2))  # trees drafted before: not scored
    scheduled = np.array([1, 1])
    positions = torch.tensor([9, 4])
    batch = SimpleNamespace(
        num_reqs=2, num_draft_tokens=0, num_draft_tokens_per_req=num_draft_tokens_per_req,
        idx_mapping=torch.tensor([2, 0]), num_scheduled_tokens=scheduled,
        seq_lens=torch.tensor([10, 5], dtype=torch.int32),
        query_start_loc_np=np.concatenate([[0], np.cumsum(scheduled)]),
        req_ids=["a", "b"], positions=positions)
    assert batch_tree_step(batch, store, conv_width=4) is None
    step = batch_tree_step(batch, store, conv_width=4, draftless=True)
    assert step.token_rows.tolist() == [[0], [1]] and step.num_nodes_host.tolist() == [1, 1]
    assert step.prefix_lens.tolist() == [9, 4] and step.meta.parents.tolist() == [[-1], [-1]]
    assert not step.has_trees and step.tree_nodes is None


def test_node_logits_take_each_requests_last_rows():
    logits = torch.arange(9.0).view(9, 1)  # rows 0..8: requests of 3, 1 and 5 logits rows
    ends = torch.tensor([3, 4, 9])
    out = node_logits(logits, ends, torch.tensor([3, 1, 4]), 4)[..., 0]
    assert out.tolist() == [[0, 1, 2, 0], [3, 0, 0, 0], [5, 6, 7, 8]]


def test_node_logits_of_a_full_batch_are_the_logits_by_node():
    """A uniform decode batch (every request ``width`` rows): the same rows as the gather,
    a view of the bf16 logits (no copy), whose greedy verification is the float32 one."""
    logits = torch.randn(12, 5).bfloat16()
    ends, counts = torch.tensor([4, 8, 12]), torch.full((3,), 4)
    full = node_logits(logits, ends, counts, 4, full=True)
    assert full.dtype == torch.bfloat16 and full.shape == (3, 4, 5)
    assert full.data_ptr() == logits.data_ptr()
    assert torch.equal(full, node_logits(logits, ends, counts, 4))
    tree = _trees(11, 3)
    rows = torch.randn(3, tree.max_nodes, VOCAB).bfloat16()
    rows.scatter_(2, tree.tokens.roll(-1, 1)[..., None], 4.0)  # paths to accept
    rows[0, 0, :2] = 9.0  # a tie: both dtypes take the first maximum
    got, want = verify_greedy(tree, rows), verify_greedy(tree, rows.float())
    for field in dataclasses.fields(got):
        assert torch.equal(getattr(got, field.name), getattr(want, field.name)), field.name


def test_verify_batch_greedy_is_the_greedy_verifier_and_sampled_rows_accept_paths():
    seed = 23
    print("seed", seed)
    generator = torch.Generator().manual_seed(seed)
    tree = _trees(seed, 4)
    logits = torch.randn(4, tree.max_nodes, VOCAB, generator=generator)
    # Make some drafts the target's argmax so that paths get accepted.
    logits.scatter_(2, tree.tokens.roll(-1, 1)[..., None], 8.0)
    plain = np.zeros(4, dtype=bool)  # deterministic trees
    greedy = verify_batch(tree, logits, np.zeros(4), plain, torch.arange(4), "auto")
    expected = verify_greedy(tree, logits)
    assert torch.equal(greedy.accepted_leaf, expected.accepted_leaf)
    assert torch.equal(greedy.output_tokens, expected.output_tokens)
    mixed = verify_batch(tree, logits, np.array([0.0, 1.0, 0.0, 0.7]), plain, torch.arange(4),
                         "auto")
    assert torch.equal(mixed.accepted_leaf[[0, 2]], expected.accepted_leaf[[0, 2]])
    tokens = sampled_tokens(mixed, tree.max_nodes)
    assert tokens.shape == (4, tree.max_nodes)
    for r in range(4):
        count = int(mixed.accepted_len[r]) + 1
        assert (tokens[r, :count] >= 0).all() and (tokens[r, count:] == -1).all()


def test_refused_sampling_fields_are_named():
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    supported = SamplingParams(temperature=0.8, seed=3, top_k=20, top_p=0.95, logprobs=2,
                               prompt_logprobs=1, presence_penalty=0.5,
                               repetition_penalty=1.1, min_tokens=4, bad_words=["x"],
                               allowed_token_ids=[1, 2])
    assert refused_sampling_field(supported) is None
    structured = SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+"))
    assert refused_sampling_field(structured).startswith("structured_outputs=")
    assert refused_sampling_field(SamplingParams(thinking_token_budget=8)) == (
        "thinking_token_budget=8")


def test_async_scheduling_is_taken_on_v2_only():
    """V2's tree steps read the device's token counts (batch_tree_step above has no host
    count at all), so model runner V2 takes async scheduling; V1 refuses it, naming why."""
    from vllm_tfm.vllm_glue.config import _check_async_scheduling

    for value in (None, False, True):
        _check_async_scheduling(value, "v2")
    _check_async_scheduling(None, "v1")
    with pytest.raises(ValueError, match="async_scheduling must be False .* model runner V1"):
        _check_async_scheduling(True, "v1")


@pytest.mark.parametrize(("runner", "given", "handed"), [
    ("v2", None, None), ("v2", False, False), ("v2", True, True), ("v1", None, False),
    ("v1", False, False)])
def test_engine_config_keeps_async_scheduling_on_v2_only(monkeypatch, runner, given, handed):
    """vLLM's create_engine_config sees the user's async_scheduling on V2 (unset: vLLM's
    default, on) and False on V1; the engine args get their value back afterwards."""
    from vllm_tfm.vllm_glue import config

    class Handed(Exception):
        pass

    def create_engine_config(engine_args):
        raise Handed(engine_args.async_scheduling)

    monkeypatch.setattr(config, "_on_cpu", lambda: False)
    monkeypatch.setattr(config, "choose_runner", lambda engine_args: runner)
    monkeypatch.setattr(config, "select_model_runner", lambda chosen: None)
    # The EngineArgs fields the wrapper reads (a real EngineArgs resolves its model).
    engine_args = SimpleNamespace(
        async_scheduling=given, enable_prefix_caching=False, additional_config=None,
        attention_backend=None, attention_config=SimpleNamespace(backend=None),
        **{name: 1 for name in ("tensor_parallel_size", *config.UNSUPPORTED_PARALLELISM)},
        speculative_config={"method": "dflash_tfm", "model": "unused",
                            "num_speculative_tokens": 7, "tree": "chain"})
    with pytest.raises(Handed) as raised:
        config.wrap_create_engine_config(create_engine_config)(engine_args)
    assert raised.value.args == (handed,)
    assert engine_args.async_scheduling is given
