"""The V2 tree speculator's draft round (vllm_glue/v2/speculator.py), on CPU.

On model runner V2 the round runs inside ``_generate_draft``, the draft forward vLLM
captures as a FULL graph per padded request count and replays (or runs eagerly when the
batch has no captured size). vLLM 0.33's speculator cannot run here, so the parent's
``propose`` is replaced by what it does around ``_generate_draft``: the bonus tokens
(roots) into the first query row of each request's block, the sample indices of the D mask
rows, then ``_generate_draft`` on the padded row count (a replay) or the exact one (eager);
the drafter's forward returns seeded random states. Each step's trees, read back from the
request slots, must be ``draft_trees``' trees for the same roots, pools, h_v and DFlash
states (same nodes exactly; path scores to float rounding, as test_draft_round.py allows:
a bucket's Weaver runs more rows). Requests the ``verify`` rule gives a sampled tree
(``sampled_tree_rows`` of V2's per-slot temperatures) get ``draft_trees_per_request``'s
sampled tree, seeded by their request's seed and the root's position, in a sampling round;
the others the deterministic tree, and a batch without such a request runs the
deterministic round. Slots outside the batch keep their trees; padded rows, dummy runs and
vLLM's capture of the draft forward write only the spare slot.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_drafter_pools import drafter
from test_proposer_rounds import D, P, V, WIDTH, _same_tree, _weaver
from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

from vllm_tfm.drafting.draft_round import candidate_pools, draft_trees_per_request
from vllm_tfm.options import TfmOptions
from vllm_tfm.vllm_glue.v2.speculator import TreeSpeculator
from vllm_tfm.vllm_glue.v2.trees import SlotTrees
from vllm_tfm.vllm_glue.v2.verify import step_seeds
from vllm_tfm.vllm_glue.verify import sampled_tree_rows

MAX_REQS, BUDGET = 6, 20
BLOCK = 1 + D
# (batch, rows _generate_draft runs): replays padded to a captured size, eager exact.
STEPS = [(3, 4), (5, 5), (1, 2), (6, 6), (2, 4)]


def _speculator(tree: str, gen: torch.Generator, budgets=(BUDGET,), verify: str = "auto",
                max_reqs: int = MAX_REQS, budget: int = BUDGET, depth: int = D, pool: int = P,
                vocab: int = V, weaver=None) -> TreeSpeculator:
    """A TreeSpeculator with the attributes vLLM's __init__ sets that the round reads, and
    the per-slot temperatures the model state files (all greedy); ``budgets``: the k a step
    may draft (the batch-size schedule's); a tree "weaver" takes ``weaver`` (None: a random
    one of this module's shapes)."""
    spec = TreeSpeculator.__new__(TreeSpeculator)
    spec.options = TfmOptions(budget=budget, tree=tree, candidate_pool=pool, verify=verify)
    if tree == "weaver" and weaver is None:
        weaver = _weaver(int(torch.randint(1 << 30, (1,), generator=gen)))
    spec.weaver = weaver
    block = 1 + depth
    spec.max_num_reqs, spec.num_speculative_steps = max_reqs, depth
    spec.num_query_per_req = block
    spec.input_buffers = SimpleNamespace(
        input_ids=torch.full((max_reqs * block,), -5, dtype=torch.int32))
    spec.sample_indices = torch.zeros(max_reqs * depth, dtype=torch.int64)
    spec.sample_pos = torch.zeros(max_reqs * depth, dtype=torch.int64)
    spec.model = drafter(torch.randn(vocab, WIDTH, generator=gen))
    spec._init_round({}, torch.device("cpu"), budgets)
    spec.engine.temperature = np.zeros(max_reqs, dtype=np.float32)
    return spec


@pytest.fixture
def vllm_propose(monkeypatch):
    """DFlashSpeculator.propose as far as the round sees it; ``rows[0]`` picks the row count
    _generate_draft runs (the captured size, or the batch: eager). The batch's
    ``root_positions`` (a test field) place each block: its mask rows follow the root."""
    rows = [None]

    def propose(self, input_batch, attn_metadata, slot_mappings, last_hidden_states,
                aux_hidden_states, num_sampled, num_rejected, last_sampled,
                next_prefill_tokens, temperature, seeds, dummy_run=False,
                num_speculative_tokens=None, **kwargs):
        n, padded = input_batch.num_reqs, rows[0]
        depth, block = self.num_speculative_steps, self.num_query_per_req
        ids = self.input_buffers.input_ids
        ids.zero_()  # padded query rows hold token 0, as prepare_dflash_inputs writes them
        ids[: n * block : block] = last_sampled[input_batch.idx_mapping[:n].long(), 0].int()
        mask_row = torch.arange(n * depth)
        self.sample_indices.zero_()  # padded sample rows read query row 0
        self.sample_indices[: n * depth] = mask_row // depth * block + 1 + mask_row % depth
        self.sample_pos.zero_()
        self.sample_pos[: n * depth] = (input_batch.root_positions.repeat_interleave(depth)
                                        + 1 + mask_row % depth)
        self._generate_draft(padded, padded * block, None, None, None)
        return torch.zeros(n, depth, dtype=torch.int64)

    monkeypatch.setattr(DFlashSpeculator, "propose", propose)
    return rows


def _batch(gen, n: int, num_tokens: int):
    slots = torch.randperm(MAX_REQS, generator=gen)[:n]
    starts = torch.sort(torch.randperm(num_tokens - 1, generator=gen)[: n - 1] + 1).values
    query_start_loc = torch.cat([torch.tensor([0]), starts, torch.tensor([num_tokens])])
    return SimpleNamespace(num_reqs=n, num_tokens=num_tokens, idx_mapping=slots.int(),
                           idx_mapping_np=slots.int().numpy(),
                           query_start_loc=query_start_loc.int(),
                           root_positions=torch.randint(5, 300, (n,), generator=gen))


@pytest.mark.parametrize("tree", ["weaver", "ddtree", "chain"])
def test_a_v2_steps_trees_from_the_round_are_draft_trees_trees(tree, gen, vllm_propose,
                                                               monkeypatch):
    spec = _speculator(tree, gen)
    states = torch.randn(MAX_REQS * BLOCK, WIDTH, generator=gen)
    monkeypatch.setattr(spec, "_run_model", lambda num_tokens, *args: states[:num_tokens])
    store = spec.engine.trees
    for number, (n, padded) in enumerate(STEPS):
        vllm_propose[0] = padded
        states.normal_(generator=gen)
        num_tokens = n + 5
        batch = _batch(gen, n, num_tokens)
        slots = batch.idx_mapping.long()
        hidden = torch.randn(num_tokens + 3, WIDTH, generator=gen)  # rows past the batch
        last_sampled = torch.randint(0, V, (MAX_REQS, 1), generator=gen)
        # Greedy requests, cool ones (a deterministic tree under "auto" for a Weaver) and
        # hot ones; step 2 is greedy only.
        choices = torch.tensor([0.0] if number == 2 else [0.0, 0.5, 1.0])
        temperature = choices[torch.randint(len(choices), (MAX_REQS,), generator=gen)]
        temperature[0] = 1.0 if number != 2 else 0.0  # slot 0 wants a sampled tree
        seeds = torch.randint(-(1 << 62), 1 << 62, (MAX_REQS,), generator=gen)
        spec.engine.temperature[:] = temperature.numpy()
        if number % 2:  # a step after a tree step: h_v from the rows that made the roots
            bonus_rows = torch.randperm(num_tokens, generator=gen)[:n]
            spec.engine.step = SimpleNamespace(
                accepted_leaf=torch.zeros(n), bonus_rows=lambda rows=bonus_rows: rows,
                context_order=lambda: torch.randperm(num_tokens, generator=gen))
            h_v = hidden[bonus_rows]
        else:
            spec.engine.step = None
            h_v = hidden[batch.query_start_loc[1:].long() - 1]
        others = torch.tensor([s for s in range(MAX_REQS) if s not in slots.tolist()])
        kept = store.gather(others) if others.numel() else None
        drafts = spec.propose(batch, None, None, hidden, None, None, None, last_sampled,
                              None, temperature, seeds)

        mask_states = states[: n * BLOCK].view(n, BLOCK, WIDTH)[:, 1:]
        pools = candidate_pools(spec.model.compute_logits(mask_states), P)
        sampled = sampled_tree_rows(spec.options, temperature[slots].numpy())
        want = draft_trees_per_request(
            tree, last_sampled[slots, 0], pools, BUDGET, sampled.tolist(),
            step_seeds(seeds[slots], batch.root_positions), weaver=spec.weaver, h_v=h_v,
            dflash_hidden=mask_states, fanout=spec.options.fanout,
            expand_width=spec.options.expand_width_for(BUDGET), backend="torch")
        expected = SlotTrees.allocate(MAX_REQS, 1 + BUDGET, D, torch.device("cpu"), (D, P))
        expected.store(slots, want)
        print(f"step {number}: batch {n}, round on {padded} rows, sampled {sampled}")
        assert spec.round_sampling == sampled.any()
        if tree == "chain":
            assert not sampled.any() and store.sampled is None
        else:
            assert store.sampled_rows(slots.numpy()).tolist() == sampled.tolist()
        _same_tree(store.gather(slots), expected.gather(slots))
        if sampled.any():  # the draws traversal reads
            rows = torch.from_numpy(sampled)
            got, wanted = store.gather(slots, draws=True), expected.gather(slots, draws=True)
            assert torch.equal(got.pool_ids[rows], wanted.pool_ids[rows])
            torch.testing.assert_close(got.proposal_logq[rows], wanted.proposal_logq[rows],
                                       rtol=0, atol=1e-5)
        assert torch.equal(drafts, expected.draft_tokens(slots, BUDGET))
        assert (store.gather(slots).num_nodes > 1).all()
        if kept is not None:  # padded rows went to the spare slot, not to these
            _same_tree(store.gather(others), kept)
        assert spec.tree_slots[n:].eq(MAX_REQS).all()


def test_dummy_runs_write_only_the_spare_slot(gen, vllm_propose, monkeypatch):
    spec = _speculator("weaver", gen)
    states = torch.randn(MAX_REQS * BLOCK, WIDTH, generator=gen)
    monkeypatch.setattr(spec, "_run_model", lambda num_tokens, *args: states[:num_tokens])
    store = spec.engine.trees
    vllm_propose[0] = 4
    batch = _batch(gen, 3, 9)
    last_sampled = torch.randint(0, V, (MAX_REQS, 1), generator=gen)
    spec.propose(batch, None, None, torch.randn(9, WIDTH, generator=gen), None, None, None,
                 last_sampled, None, None, None)
    every_slot = torch.arange(MAX_REQS)
    before = store.gather(every_slot)
    spare_before = store.gather(torch.tensor([MAX_REQS]))
    states.normal_(generator=gen)
    spec.propose(_batch(gen, 4, 9), None, None, torch.randn(9, WIDTH, generator=gen), None,
                 None, None, torch.randint(0, V, (MAX_REQS, 1), generator=gen), None, None,
                 None, dummy_run=True)
    _same_tree(store.gather(every_slot), before)
    assert spec.tree_slots.eq(MAX_REQS).all()
    assert not torch.equal(store.gather(torch.tensor([MAX_REQS])).tokens, spare_before.tokens)


def test_vllms_capture_of_the_draft_forward_writes_only_the_spare_slot(gen, vllm_propose,
                                                                     monkeypatch):
    spec = _speculator("ddtree", gen)
    states = torch.randn(MAX_REQS * BLOCK, WIDTH, generator=gen)
    monkeypatch.setattr(spec, "_run_model", lambda num_tokens, *args: states[:num_tokens])
    vllm_propose[0] = 5
    batch = _batch(gen, 5, 11)
    spec.propose(batch, None, None, torch.randn(11, WIDTH, generator=gen), None, None, None,
                 torch.randint(0, V, (MAX_REQS, 1), generator=gen), None, None, None)
    every_slot = torch.arange(MAX_REQS)
    before = spec.engine.trees.gather(every_slot)
    states.normal_(generator=gen)
    # What DFlashCudaGraphManager.capture does per captured size: warm-up, then capture.
    monkeypatch.setattr(DFlashSpeculator, "capture", lambda self: [
        self._generate_draft(rows, rows * BLOCK, None, None, None) for rows in (6, 6, 2, 2)])
    spec.capture()
    _same_tree(spec.engine.trees.gather(every_slot), before)


def test_draft_graphs_store_the_context_of_every_tree_row(gen):
    """vLLM's DFlash graph stores num_reqs * (1 + D) context rows, a chain step's; a tree
    step of budget k scores 1 + k rows a request, and every one of them must be stored in
    the graph of that k (the rows past the graph's were stored eagerly before each
    replay), up to the batch's token limit."""
    spec = _speculator("ddtree", gen, budgets=(4, BUDGET))
    spec.max_num_tokens = 100
    assert BUDGET > D  # the case: a tree step has more rows than vLLM's block
    for k, num_reqs, rows in ((BUDGET, 1, 1 + BUDGET), (BUDGET, 4, 84), (BUDGET, 6, 100),
                              (4, 6, 30)):
        spec._use_round(k)
        assert spec._num_graph_context_tokens(num_reqs) == rows


@pytest.mark.parametrize("aux_layers", [0, 3])
def test_vllm_stores_the_drafters_context_in_context_order(aux_layers, gen, monkeypatch):
    """After a tree step vLLM's DFlash is handed the batch's hidden-state rows in the
    step's context order (the accepted path first): with aux layers their rows
    concatenated side by side, as vLLM concatenates them, else the last layer's."""
    spec = _speculator("chain", gen)
    seen = {}

    def propose(self, input_batch, attn_metadata, slot_mappings, last_hidden_states,
                aux_hidden_states, *args, **kwargs):
        seen.update(last=last_hidden_states, aux=aux_hidden_states)
        return torch.zeros(input_batch.num_reqs, D, dtype=torch.int64)

    monkeypatch.setattr(DFlashSpeculator, "propose", propose)
    num_tokens = 9
    order = torch.randperm(num_tokens, generator=gen)
    spec.engine.step = SimpleNamespace(
        accepted_leaf=torch.zeros(2), bonus_rows=lambda: torch.tensor([3, 8]),
        context_order=lambda: order)
    last = torch.randn(num_tokens + 3, WIDTH, generator=gen)  # rows past the batch
    aux = [torch.randn(num_tokens + 3, WIDTH, generator=gen) for _ in range(aux_layers)]
    spec.propose(_batch(gen, 2, num_tokens), None, None, last, aux or None, None, None,
                 torch.zeros(MAX_REQS, 1, dtype=torch.int64), None, None, None)
    if aux_layers:
        [stored] = seen["aux"]
        assert torch.equal(stored, torch.cat([h[:num_tokens] for h in aux], dim=-1)[order])
        assert seen["last"] is last
    else:
        assert seen["aux"] is None
        assert torch.equal(seen["last"], last[order])
