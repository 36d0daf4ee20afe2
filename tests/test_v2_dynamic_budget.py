"""The batch-size-aware budget on model runner V2 (vLLM's dynamic speculative decoding), on
CPU: the plugin's rule as vLLM's ``num_speculative_tokens_per_batch_size`` and back
(options.py, vllm_glue/config.py), the round budgets a schedule gives, the tree speculator
drafting each step's k in the draft graphs of that k (vllm_glue/v2/speculator.py), the
capture steps per query length 1 + k and steps of alternating k bound and committed as
the eager steps of those budgets (v2/model_state.py: through the graphs' buffers and V2's
persistent block tables, with no host read), and greedy verification equal to
greedy decoding whatever k a step drafts."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from host_reads import no_host_reads, run_as_on_cuda
from test_tree_graphs import (
    CHANNELS,
    HV,
    K,
    NULL_SLOT,
    V,
    WIDTH,
    _eager_copy,
    fake_gdn_layer,
    gdn_forward,
    rewrite_like_a_replay,
)
from test_v2_rounds import BLOCK, MAX_REQS, _batch, _speculator, vllm_propose  # noqa: F401
from test_v2_rounds import BUDGET as ROUND_BUDGET
from test_v2_rounds import D as ROUND_DEPTH
from test_v2_rounds import P as ROUND_POOL
from test_v2_rounds import V as ROUND_VOCAB
from test_v2_rounds import WIDTH as ROUND_WIDTH
from test_v2_rounds import _same_tree
from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup
from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

from vllm_tfm.drafting.draft_round import candidate_pools, draft_trees
from vllm_tfm.options import (
    MAX_BATCH,
    TfmOptions,
    batch_size_schedule,
    budget_for_batch,
    budget_table_from_schedule,
    default_budget_table,
)
from vllm_tfm.vllm_glue.commit import commit_gdn_records, commit_kv
from vllm_tfm.vllm_glue.config import BATCH_SCHEDULE_KEY, batch_size_budgets
from vllm_tfm.vllm_glue.tree_graphs import graphable
from vllm_tfm.vllm_glue.v2 import model_state
from vllm_tfm.vllm_glue.v2.model_state import TreeModelState, graphed_steps_by_length
from vllm_tfm.vllm_glue.v2.speculator import RoundMode, round_budgets
from vllm_tfm.vllm_glue.v2.trees import (
    SlotTrees,
    apply_tree_positions,
    batch_tree_step,
    restore_linear_positions,
)
from vllm_tfm.vllm_glue.v2.verify import sampled_tokens, verify_batch

MAX_SEQS = 300


def _lookup(schedule, budget: int) -> list[int]:
    """vLLM's dense batch size -> k lookup (the scheduler's), index 0 unused."""
    return build_dynamic_sd_schedule_lookup(schedule, MAX_SEQS, budget)


# -- the rule as vLLM's schedule, and back --------------------------------------------------

def test_the_default_table_becomes_the_schedule_vllm_reads_as_the_same_rule():
    table = default_budget_table(64)
    schedule = batch_size_schedule(table, 64)
    assert schedule == [(1, 1, 64), (2, 2, 32), (3, 15, 16), (16, MAX_BATCH, 8)]
    lookup = _lookup(schedule, 64)
    assert all(lookup[n] == budget_for_batch(table, n) for n in range(1, MAX_SEQS + 1))


def test_a_user_table_becomes_its_schedule_capped_at_the_budget():
    table = ((4, 32), (16, 8), (40, 2))
    schedule = batch_size_schedule(table, 16)
    assert schedule == [(1, 4, 16), (5, 16, 8), (17, 40, 2)]
    lookup = _lookup(schedule, 16)
    for n in range(1, MAX_SEQS + 1):  # past the table: the last row's budget, in both
        assert lookup[n] == min(budget_for_batch(table, n), 16), n


def test_a_vllm_schedule_with_gaps_becomes_a_table_that_picks_the_same_k():
    schedule = [(1, 2, 64), (5, 8, 16), (10, 20, 100), (30, 31, 4)]
    table = budget_table_from_schedule(schedule, 32)
    assert table == ((4, 32), (9, 16), (29, 32), (31, 4))  # k capped at 32
    lookup = _lookup(schedule, 32)
    assert all(lookup[n] == budget_for_batch(table, n) for n in range(1, MAX_SEQS + 1))


def _options(**fields) -> TfmOptions:
    return TfmOptions(**{"budget": 64, "tree": "ddtree", **fields})


def test_on_v2_the_plugins_rule_fills_vllms_schedule():
    spec = {"method": "dflash", "num_speculative_tokens": 64}
    default = default_budget_table(64)
    assert batch_size_budgets(_options(), spec, "v2") == _options()  # the default table
    assert spec[BATCH_SCHEDULE_KEY] == batch_size_schedule(default, 64)
    spec = {"method": "dflash", "num_speculative_tokens": 64}
    options = batch_size_budgets(_options(budget_by_batch=default), spec, "v2")
    assert options == _options(budget_by_batch=default)
    assert spec[BATCH_SCHEDULE_KEY] == batch_size_schedule(default, 64)
    table = ((1, 64), (8, 16), (MAX_BATCH, 8))
    spec = {"method": "dflash"}
    batch_size_budgets(_options(budget_by_batch=table), spec, "v2")
    assert spec[BATCH_SCHEDULE_KEY] == [(1, 1, 64), (2, 8, 16), (9, MAX_BATCH, 8)]
    spec = {"method": "dflash"}  # one budget at every batch size: vLLM's static k
    batch_size_budgets(_options(budget_by_batch=((4, 64), (MAX_BATCH, 64))), spec, "v2")
    assert BATCH_SCHEDULE_KEY not in spec


def test_on_v2_the_plugins_rule_follows_a_schedule_the_user_gave():
    user = [[1, 4, 32], [5, 64, 8]]
    spec = {"method": "dflash", BATCH_SCHEDULE_KEY: user}
    options = batch_size_budgets(_options(), spec, "v2")
    assert spec[BATCH_SCHEDULE_KEY] is user  # vLLM reads the user's own
    assert options.budget_by_batch == ((4, 32), (64, 8))
    lookup = _lookup(user, 64)
    assert all(lookup[n] == options.step_budget(n) for n in range(1, MAX_SEQS + 1))


def test_on_v2_the_engine_is_sized_to_the_largest_k_its_rule_drafts():
    # V2 warms up with num_speculative_tokens drafts; the speculator captures the rule's ks.
    default = default_budget_table(127)
    assert max(budget for _, budget in default) == 64  # 128 nodes do not fit the step tokens
    spec = {"method": "dflash", "num_speculative_tokens": 127}
    options = batch_size_budgets(_options(budget=127), spec, "v2")
    assert options == _options(budget=64, budget_by_batch=default)
    assert spec["num_speculative_tokens"] == 64
    assert spec[BATCH_SCHEDULE_KEY] == batch_size_schedule(default, 127)
    config = SimpleNamespace(num_speculative_tokens=64,
                             num_speculative_tokens_per_batch_size=spec[BATCH_SCHEDULE_KEY])
    assert round_budgets(config, MAX_SEQS)[-1] == 64
    lookup = _lookup(spec[BATCH_SCHEDULE_KEY], 64)
    assert all(lookup[n] == options.step_budget(n) for n in range(1, MAX_SEQS + 1))
    spec = {"method": "dflash", "num_speculative_tokens": 64}  # one k under the budget: static
    options = batch_size_budgets(_options(budget_by_batch=((MAX_BATCH, 16),)), spec, "v2")
    assert (options.budget, spec["num_speculative_tokens"]) == (16, 16)
    assert BATCH_SCHEDULE_KEY not in spec
    user = [[1, 4, 32], [5, 64, 8]]
    spec = {"method": "dflash", "num_speculative_tokens": 64, BATCH_SCHEDULE_KEY: user}
    options = batch_size_budgets(_options(), spec, "v2")
    assert (options.budget, spec["num_speculative_tokens"]) == (32, 32)
    assert options.budget_by_batch == ((4, 32), (64, 8))


def test_both_rules_given_is_an_error_naming_both_fields():
    spec = {"method": "dflash", BATCH_SCHEDULE_KEY: [(1, 8, 16)]}
    with pytest.raises(ValueError, match=f"'budget_by_batch' and '{BATCH_SCHEDULE_KEY}'"):
        batch_size_budgets(_options(budget_by_batch=((MAX_BATCH, 16),)), spec, "v2")


@pytest.mark.parametrize("schedule, words", [
    ([(2, 8, 16)], "must start at 1"),
    ([(1, 8, 16), (4, 9, 8)], "non-overlapping"),
    ([(1, 8, 0)], r"every k must be in \[1, num_speculative_tokens = 64\]"),
])
def test_a_bad_user_schedule_is_refused_naming_the_field(schedule, words):
    with pytest.raises(ValueError, match=f"{BATCH_SCHEDULE_KEY}.*{words}"):
        batch_size_budgets(_options(), {BATCH_SCHEDULE_KEY: schedule}, "v2")


def test_v1_keeps_the_plugins_rule_and_refuses_vllms_schedule():
    spec = {"method": "dflash"}
    options = _options(budget_by_batch=((2, 64), (MAX_BATCH, 16)))
    assert batch_size_budgets(options, spec, "v1") is options
    assert BATCH_SCHEDULE_KEY not in spec  # vLLM would force PIECEWISE graphs on V1
    with pytest.raises(ValueError, match=f"{BATCH_SCHEDULE_KEY}.*model runner V2.*"
                                         "budget_by_batch"):
        batch_size_budgets(_options(), {BATCH_SCHEDULE_KEY: [(1, 8, 16)]}, "v1")


def test_round_budgets_are_the_ks_of_vllms_lookup():
    def config(schedule, budget=64):
        return SimpleNamespace(num_speculative_tokens=budget,
                               num_speculative_tokens_per_batch_size=schedule)

    assert round_budgets(config(None), 8) == (64,)
    default = config(batch_size_schedule(default_budget_table(64), 64))
    assert round_budgets(default, 32) == (8, 16, 32, 64)
    assert round_budgets(default, 8) == (16, 32, 64)  # 8 drafts from 16 requests on
    # Capped at the budget, and only the ks the running batch sizes reach.
    assert round_budgets(config([(1, 1, 100), (2, 8, 16), (9, 64, 4)]), 8) == (16, 64)


# -- the speculator: each step's k, in that k's draft graphs ---------------------------------

ROUND_BUDGETS = (4, 8, ROUND_BUDGET)


@pytest.fixture
def draft_graph_managers(monkeypatch):
    """vLLM's DFlash graph manager per init_cudagraph_manager call: an empty one."""
    from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager

    made = []

    def init(self, mode):
        self.query_cudagraph_manager = CudaGraphManager.__new__(CudaGraphManager)
        made.append(self.query_cudagraph_manager)

    monkeypatch.setattr(DFlashSpeculator, "init_cudagraph_manager", init)
    return made


@pytest.fixture
def replayed_graphs(vllm_propose, monkeypatch):  # noqa: F811
    """The speculator's current draft graph manager at every vLLM propose, in order."""
    replayed = []
    inner = DFlashSpeculator.propose

    def propose(self, *args, **kwargs):
        replayed.append(self.query_cudagraph_manager)
        return inner(self, *args, **kwargs)

    monkeypatch.setattr(DFlashSpeculator, "propose", propose)
    return replayed


@pytest.mark.parametrize("tree", ["ddtree", "chain"])
def test_steps_of_alternating_k_draft_trees_of_that_budget(tree, gen, vllm_propose,  # noqa: F811
                                                          draft_graph_managers, monkeypatch,
                                                          replayed_graphs):
    spec = _speculator(tree, gen, ROUND_BUDGETS)
    spec.init_cudagraph_manager("FULL")
    assert sorted(spec.draft_graphs) == list(ROUND_BUDGETS)
    assert len({id(m) for m in spec.draft_graphs.values()}) == len(ROUND_BUDGETS)
    states = torch.randn(MAX_REQS * BLOCK, ROUND_WIDTH, generator=gen)
    monkeypatch.setattr(spec, "_run_model", lambda num_tokens, *args: states[:num_tokens])
    store = spec.engine.trees
    for number, (n, padded, k) in enumerate([(3, 4, ROUND_BUDGET), (5, 6, 4),
                                             (2, 2, ROUND_BUDGET), (4, 4, 8), (1, 2, 4)]):
        vllm_propose[0] = padded
        states.normal_(generator=gen)
        num_tokens = n + 5
        batch = _batch(gen, n, num_tokens)
        slots = batch.idx_mapping.long()
        hidden = torch.randn(num_tokens, ROUND_WIDTH, generator=gen)
        last_sampled = torch.randint(0, ROUND_VOCAB, (MAX_REQS, 1), generator=gen)
        spec.engine.step = None
        drafts = spec.propose(batch, None, None, hidden, None, None, None, last_sampled,
                              None, None, None, num_speculative_tokens=k)
        print(f"step {number}: batch {n}, k {k}")
        assert replayed_graphs[-1] is spec.draft_graphs[k]
        mask_states = states[: n * BLOCK].view(n, BLOCK, ROUND_WIDTH)[:, 1:]
        pools = candidate_pools(spec.model.compute_logits(mask_states), ROUND_POOL)
        want = draft_trees(tree, last_sampled[slots, 0], pools, k, fanout=spec.options.fanout,
                           expand_width=spec.options.expand_width_for(k), backend="torch")
        expected = SlotTrees.allocate(MAX_REQS, 1 + ROUND_BUDGET, ROUND_DEPTH,
                                      torch.device("cpu"))
        expected.store(slots, want)
        _same_tree(store.gather(slots), expected.gather(slots))
        assert int(store.gather(slots).num_nodes.max()) <= 1 + k
        assert drafts.shape == (n, ROUND_BUDGET)
        assert torch.equal(drafts, expected.draft_tokens(slots, k))
        assert drafts[:, k:].eq(-1).all()


def test_a_step_of_a_k_outside_the_schedule_is_refused(gen, vllm_propose):  # noqa: F811
    spec = _speculator("ddtree", gen, ROUND_BUDGETS)
    with pytest.raises(RuntimeError, match=r"k = 5, not one of the round budgets \[4, 8, 20\]"):
        spec.propose(_batch(gen, 2, 6), None, None, torch.randn(6, ROUND_WIDTH), None, None,
                     None, torch.zeros(MAX_REQS, 1, dtype=torch.int64), None, None, None,
                     num_speculative_tokens=5)


def test_dummy_runs_draft_the_largest_k_of_the_schedule(gen, vllm_propose,  # noqa: F811
                                                      monkeypatch):
    # A schedule that never reaches num_speculative_tokens (20): its largest k is 8.
    spec = _speculator("ddtree", gen, (4, 8))
    states = torch.randn(MAX_REQS * BLOCK, ROUND_WIDTH, generator=gen)
    monkeypatch.setattr(spec, "_run_model", lambda num_tokens, *args: states[:num_tokens])
    vllm_propose[0] = 3
    drafts = spec.propose(_batch(gen, 3, 8), None, None, torch.randn(8, ROUND_WIDTH), None,
                          None, None, torch.randint(0, ROUND_VOCAB, (MAX_REQS, 1)), None,
                          None, None, dummy_run=True)
    assert spec.round_budget == 8 and drafts[:, 8:].eq(-1).all()
    assert int(spec.engine.trees.gather(torch.tensor([MAX_REQS])).num_nodes[0]) <= 9


def test_the_capture_records_the_round_of_each_k_in_its_own_graphs(gen, vllm_propose,  # noqa: F811
                                                                  draft_graph_managers,
                                                                  monkeypatch):
    spec = _speculator("ddtree", gen, ROUND_BUDGETS)
    spec.init_cudagraph_manager("FULL")
    states = torch.randn(MAX_REQS * BLOCK, ROUND_WIDTH, generator=gen)
    monkeypatch.setattr(spec, "_run_model", lambda num_tokens, *args: states[:num_tokens])
    every_slot = torch.arange(MAX_REQS)
    before = spec.engine.trees.gather(every_slot)
    captured = []
    spare = torch.tensor([MAX_REQS])

    def capture(self):  # DFlashCudaGraphManager.capture per size: warm-up, then capture
        for rows in (6, 6, 2, 2):
            self._generate_draft(rows, rows * BLOCK, None, None, None)
        captured.append((self.round_budget, self.round_mode, self.query_cudagraph_manager,
                         int(self.engine.trees.gather(spare).num_nodes[0])))

    monkeypatch.setattr(DFlashSpeculator, "capture", capture)
    spec.capture()
    # Deterministic rounds, then the sampled and the mixed ones (verify "auto" draws sampled
    # DDTrees).
    assert [(k, mode, manager) for k, mode, manager, _ in captured] == [
        (k, mode, spec.round_graphs(mode)[k]) for mode in RoundMode for k in ROUND_BUDGETS]
    assert [nodes <= 1 + k for k, _, _, nodes in captured] == [True] * 3 * len(ROUND_BUDGETS)
    assert spec.round_mode is RoundMode.DETERMINISTIC
    _same_tree(spec.engine.trees.gather(every_slot), before)  # only the spare slot
    assert spec.round_budget == ROUND_BUDGET and spec.query_cudagraph_manager is \
        spec.draft_graphs[ROUND_BUDGET]


# -- the model state: capture steps per query length, steps of alternating k ----------------

GRAPH_BUDGETS = (4, 16)


def _state() -> TreeModelState:
    state = TreeModelState.__new__(TreeModelState)
    state.graphs = graphed_steps_by_length(GRAPH_BUDGETS, WIDTH, torch.device("cpu"))
    return state


def test_a_full_capture_runs_the_capture_step_of_its_query_length():
    state = _state()
    for k, num_reqs in ((4, 3), (16, 2), (4, 1)):
        capture = SimpleNamespace(max_query_len=1 + k,
                                  num_tokens_after_padding=num_reqs * (1 + k))
        step = state._capture_step(capture)
        assert step is state.graphs[1 + k].steps[num_reqs]
        assert step.meta.parents.shape == (num_reqs, 1 + k)
    with pytest.raises(RuntimeError, match=r"query lengths \[5, 17\].*query length 9"):
        state._capture_step(SimpleNamespace(max_query_len=9, num_tokens_after_padding=18))


def triton_attention_layer(kv_cache: torch.Tensor) -> SimpleNamespace:
    """An attention layer of vLLM's TRITON_ATTN backend over ``kv_cache``
    [blocks, kv_heads, block_size, 2 * head_size] (what commit_kv reads of it)."""
    return SimpleNamespace(attn_backend=SimpleNamespace(get_name=lambda: "TRITON_ATTN"),
                           impl=SimpleNamespace(head_size=kv_cache.shape[-1] // 2),
                           kv_cache=kv_cache, layer_name="model.layers.3.self_attn")


def _v2_decode_batch(gen, store: SlotTrees, k: int, num_reqs: int, slots: torch.Tensor):
    """A uniform V2 decode batch: ``num_reqs`` requests scoring trees of budget ``k``,
    drawn and kept in ``slots`` of ``store``."""
    depth = min(k, 5)
    logits = torch.randn(num_reqs, depth, 30, generator=gen)
    roots = torch.randint(0, 30, (num_reqs,), generator=gen)
    trees = draft_trees("ddtree", roots, candidate_pools(logits, 6), k, validate=True)
    assert bool((trees.num_nodes == 1 + k).all())
    store.store(slots, trees)
    nodes = 1 + k
    scheduled = np.full(num_reqs, nodes)
    computed = torch.randint(0, 40, (num_reqs,), generator=gen).numpy()
    starts = np.arange(num_reqs + 1) * nodes
    positions = torch.from_numpy(np.concatenate([c + np.arange(nodes) for c in computed]))
    return SimpleNamespace(
        num_reqs=num_reqs, num_draft_tokens=num_reqs * k,
        num_draft_tokens_per_req=np.full(num_reqs, k), idx_mapping=slots.int(),
        num_scheduled_tokens=scheduled,
        seq_lens=torch.from_numpy(computed + scheduled).int(),
        query_start_loc_np=starts, req_ids=[f"r{r}" for r in range(num_reqs)],
        positions=positions)


def test_steps_of_alternating_k_bind_and_commit_as_their_eager_steps(gen, monkeypatch):
    seed = int(torch.randint(1 << 30, (1,), generator=gen))
    print(f"seed {seed}")
    gen = torch.Generator().manual_seed(seed)
    state = _state()
    # The model state commits K/V rows through V2's persistent forward block tables (one
    # attention group, one TRITON_ATTN layer here); each step's gather rewrites their rows.
    block_tables = torch.zeros(8, 6, dtype=torch.int32)
    state._input_block_tables = [block_tables]
    state._attention_groups = [(0, ["model.layers.3.self_attn"])]
    kv_cache = torch.randn(50, 2, 16, 2 * 8, generator=gen)
    eager_kv, initial_kv = kv_cache.clone(), kv_cache.clone()
    state.context = {"model.layers.3.self_attn": triton_attention_layer(kv_cache)}
    eager_context = {"model.layers.3.self_attn": triton_attention_layer(eager_kv)}
    kv_commits = []

    def read_block_table(context, groups, table, step):
        kv_commits.append((table(0), step.meta, step.accepted_leaf))
        commit_kv(context, groups, table, step)

    monkeypatch.setattr(model_state, "commit_kv", read_block_table)
    # The commits run their Triton kernels, whose launches read nothing back.
    import triton_ops.gdn_tree.chunk  # noqa: F401
    import triton_ops.tree_attention.kv_commit  # noqa: F401
    import triton_ops.tree_conv.conv  # noqa: F401

    run_as_on_cuda(monkeypatch)
    layer = fake_gdn_layer(gen)
    conv_weight = torch.randn(CHANNELS, WIDTH, generator=gen) * 0.3
    num_slots = 8
    conv_state = torch.randn(num_slots, CHANNELS, WIDTH - 1, generator=gen)
    ssm_state = torch.randn(num_slots, HV, K, V, generator=gen) * 0.1
    graph_conv, graph_ssm = conv_state.clone(), ssm_state.clone()
    eager_conv, eager_ssm = conv_state.clone(), ssm_state.clone()

    def inputs(count):
        return (torch.randn(count, CHANNELS, generator=gen),
                torch.randn(count, HV, generator=gen), torch.randn(count, HV, generator=gen))

    padded = 4
    captured = {}
    for k in GRAPH_BUDGETS:  # vLLM's capture of both query lengths, null slots only
        rows = padded * (1 + k)
        step = state._capture_step(SimpleNamespace(max_query_len=1 + k,
                                                   num_tokens_after_padding=rows))
        gdn_forward(inputs(rows), layer, step, torch.full((padded,), NULL_SLOT), conv_weight,
                    graph_conv, graph_ssm)
        captured[k] = (step, step.gdn_records[layer.prefix])
    assert torch.equal(graph_ssm, ssm_state) and torch.equal(graph_conv, conv_state)

    store = SlotTrees.allocate(num_slots, 1 + max(GRAPH_BUDGETS), max(GRAPH_BUDGETS),
                               torch.device("cpu"))
    for number, (k, num_reqs) in enumerate([(16, 3), (4, 4), (16, 2), (4, 1)]):
        nodes = 1 + k
        slots = torch.randperm(num_slots - 1, generator=gen)[:num_reqs] + 1
        batch = _v2_decode_batch(gen, store, k, num_reqs, slots)
        with no_host_reads():  # prepare_attn's part: the step, its positions, the binding
            step = batch_tree_step(batch, store, WIDTH)
            apply_tree_positions(batch.positions, step)
            state._bind_graph(step, padded)
        assert graphable(step, nodes) and step.meta.parents.shape == (num_reqs, nodes)
        graph_step, record = captured[k]
        assert step.graph_size == padded
        assert torch.equal(graph_step.meta.parents[:num_reqs], step.meta.parents)
        assert torch.equal(graph_step.prefix_lens[:num_reqs], step.prefix_lens)
        # Replay: real rows first, stale inputs in the padding rows.
        real = inputs(num_reqs * nodes)
        stale = inputs((padded - num_reqs) * nodes)
        graph_slots = torch.full((padded,), NULL_SLOT)
        graph_slots[:num_reqs] = slots
        replayed = gdn_forward(tuple(torch.cat([r, s]) for r, s in zip(real, stale)), layer,
                               graph_step, graph_slots, conv_weight, graph_conv, graph_ssm)
        rewrite_like_a_replay(record, graph_step.gdn_records[layer.prefix])
        graph_step.gdn_records[layer.prefix] = record  # a replay rewrites, not rebinds
        eager = _eager_copy(step)
        block_tables[:num_reqs] = torch.randint(1, 50, (num_reqs, 6), generator=gen)
        eager_out = gdn_forward(real, layer, eager, slots, conv_weight, eager_conv, eager_ssm)
        print(f"step {number}: k {k}, {num_reqs} requests")
        assert torch.allclose(replayed[: num_reqs * nodes], eager_out, atol=1e-6, rtol=1e-5)
        leaf = torch.randint(nodes, (num_reqs,), generator=gen)
        step.accepted_leaf = leaf
        with no_host_reads():  # through the graph's buffers, cut to the step's requests
            state._commit(step)
            restore_linear_positions(batch.positions, step)
        assert step.gdn_records == {}
        table, meta, committed_leaf = kv_commits.pop()
        assert table.data_ptr() == block_tables.data_ptr() and len(table) == num_reqs
        assert meta.parents.data_ptr() == graph_step.meta.parents.data_ptr()
        assert len(meta.parents) == num_reqs and torch.equal(committed_leaf, leaf)
        commit_gdn_records(eager.gdn_records.values(), leaf)
        eager.accepted_leaf = leaf
        commit_kv(eager_context, state._attention_groups,
                  lambda gid: block_tables[:num_reqs].clone(), eager)
        assert torch.equal(kv_cache, eager_kv)
        assert torch.allclose(graph_ssm, eager_ssm, atol=1e-6, rtol=1e-5)
        assert torch.allclose(graph_conv, eager_conv, atol=1e-6, rtol=1e-5)
        assert torch.equal(graph_ssm[NULL_SLOT], ssm_state[NULL_SLOT])
    assert not torch.equal(kv_cache, initial_kv)  # accepted rows moved
    with pytest.raises(RuntimeError, match="of 9 nodes that was not captured"):
        batch = _v2_decode_batch(gen, store, 8, 2, torch.tensor([1, 2]))
        state._bind_graph(batch_tree_step(batch, store, WIDTH), padded)


# -- losslessness whatever k ----------------------------------------------------------------

def _greedy_reference(table: torch.Tensor, root: int, prefix: int, length: int) -> list[int]:
    """Greedy decoding of the toy target: the next token is table[token, position]."""
    tokens, token = [], root
    for step in range(length):
        token = int(table[token, prefix + step])
        tokens.append(token)
    return tokens


@pytest.mark.parametrize("k", [1, 4, 16, 48])
def test_greedy_verification_of_a_budget_k_step_is_greedy_decoding(gen, k):
    vocab, depth, num_reqs, max_budget = 24, 6, 5, 48
    # A toy target whose argmax after a token at a position is table[token, position].
    table = torch.randint(0, vocab, (vocab, 128), generator=gen)
    prefix = torch.randint(0, 50, (num_reqs,), generator=gen)
    roots = torch.randint(0, vocab, (num_reqs,), generator=gen)
    # A drafter that often proposes the target's greedy continuation.
    logits = torch.randn(num_reqs, depth, vocab, generator=gen)
    for r in range(num_reqs):
        chain = _greedy_reference(table, int(roots[r]), int(prefix[r]), depth)
        hit = torch.rand(depth, generator=gen) < 0.7
        logits[r, torch.arange(depth)[hit], torch.tensor(chain)[hit]] += 6.0
    trees = draft_trees("ddtree", roots, candidate_pools(logits, 8), k, validate=True)
    store = SlotTrees.allocate(num_reqs, 1 + max_budget, max_budget, torch.device("cpu"))
    slots = torch.arange(num_reqs)
    store.store(slots, trees)
    tree = store.gather(slots).truncate(torch.full((num_reqs,), 1 + k))
    positions = prefix.view(-1, 1) + tree.depths
    target = torch.full((num_reqs, tree.max_nodes, vocab), -3.0)
    target.scatter_(2, table[tree.tokens, positions][..., None], 3.0)
    target += 0.1 * torch.randn(target.shape, generator=gen)
    result = verify_batch(tree, target, np.zeros(num_reqs), np.zeros(num_reqs, dtype=bool),
                          torch.arange(num_reqs), "auto")
    out = sampled_tokens(result, 1 + max_budget)
    for r in range(num_reqs):
        count = int(result.accepted_len[r]) + 1
        assert out[r, :count].tolist() == _greedy_reference(table, int(roots[r]),
                                                           int(prefix[r]), count), r
        assert out[r, count:].eq(-1).all() and count <= 1 + min(k, depth)
    assert int(result.accepted_len.sum()) > 0  # some drafts accepted


# -- bench_speed on V2: an engine per tree kind and budget, the rule on its own -------------

def test_bench_speed_on_v2_gives_each_tree_kind_and_budget_its_engine():
    from vllm_tfm.benchmarks import speed

    settings = speed.tfm_settings(("weaver", "ddtree"), (16, 64))
    v1 = speed.engine_budgets(settings, (16, 64))
    assert [(b, rule, tree) for b, rule, tree, _ in v1] == [(64, False, "weaver"),
                                                            (16, False, "weaver")]
    assert v1[0][3] == [("weaver", 64), ("weaver", None), ("ddtree", 64)]
    # V2: an engine drafts the tree kind it was started with (before, the DDTree settings
    # landed on Weaver engines and were skipped).
    v2 = speed.engine_budgets(settings, (16, 64), "v2")
    assert v2 == [(64, False, "weaver", [("weaver", 64)]), (64, True, "weaver", [("weaver", None)]),
                  (64, False, "ddtree", [("ddtree", 64)]), (16, False, "weaver", [("weaver", 16)]),
                  (16, False, "ddtree", [("ddtree", 16)])]
    config = speed.speculative_config(speed.TFM, {"dflash": "d", "weaver": "w"}, 64,
                                      ((MAX_BATCH, 64),), tree="ddtree")
    assert config["budget_by_batch"] == [[MAX_BATCH, 64]] and config["tree"] == "ddtree"

    def worker(budget_by_batch):
        options = TfmOptions(budget=64, tree="weaver", budget_by_batch=budget_by_batch)
        return SimpleNamespace(model_runner=SimpleNamespace(
            speculator=SimpleNamespace(options=options)))

    pinned, rule = worker(((MAX_BATCH, 64),)), worker(None)
    assert speed._set_tree(pinned, "weaver", 64) and not speed._set_tree(pinned, "weaver", None)
    assert speed._set_tree(rule, "weaver", None) and not speed._set_tree(rule, "weaver", 64)
    assert not speed._set_tree(pinned, "ddtree", 64) and not speed._set_tree(pinned, "weaver", 16)
    assert speed.engine_label({"method": speed.TFM, "engine_budget": 64,
                               "engine_rule": True}) == "dflash_tfm (k = 64, rule)"
    assert speed.engine_label({"method": speed.TFM, "engine_budget": 64, "engine_rule": False,
                               "engine_tree": "ddtree"}) == "dflash_tfm ddtree (k = 64)"


def test_vllms_memory_profiling_drops_every_draft_graph_manager(gen, draft_graph_managers):
    from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager

    spec = _speculator("ddtree", gen, ROUND_BUDGETS)
    spec.init_cudagraph_manager("FULL")
    count = len(ROUND_BUDGETS)
    modes = list(RoundMode)
    assert [len(spec.round_graphs(mode)) for mode in modes] == [count] * 3
    # What profile_cudagraph_memory does after profiling: every manager attribute to None.
    for name, value in list(vars(spec).items()):
        if isinstance(value, CudaGraphManager):
            setattr(spec, name, None)
    assert spec.all_draft_graphs == []
    spec.init_cudagraph_manager("FULL")  # the real initialize_kv_cache makes them anew
    made = [id(m) for m in draft_graph_managers[3 * count:]]
    assert [id(m) for mode in modes for m in spec.round_graphs(mode).values()] == made
