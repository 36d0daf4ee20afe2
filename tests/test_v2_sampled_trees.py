"""Sampled trees for sampled requests on model runner V2 (vllm_glue/v2/speculator.py,
trees.py, verify.py), on CPU, through the speculator's ``propose`` as test_v2_rounds.py
drives it.

- Exactness: the trees the V2 round stores for many seeds of one request are every
  realisation of the draw (their probabilities sum to 1), and the verifier V2 picks for
  them (traversal) gives outputs that follow the target's multi-step law to 1e-10, by
  enumeration (test_verifiers.py).
- Greedy requests are unchanged: a greedy-only batch runs the deterministic round in its
  own graphs; a greedy request beside sampled ones gets the deterministic tree.
- A sampling round reads nothing back from the device (it runs inside vLLM's draft graph).
- A seeded request's tree depends on its seed and its root's position only, not on its
  slot or the batch it sits in.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from host_reads import HostRead, no_host_reads, run_as_on_cuda
from test_proposer_rounds import WIDTH, _same_tree
from test_v2_dynamic_budget import draft_graph_managers, replayed_graphs  # noqa: F401
from test_v2_rounds import BUDGET, MAX_REQS, V, _speculator, vllm_propose  # noqa: F401
from test_verifiers import ContextLaw, assert_sampled_trees_lossless, target_probs, tiny_weaver

from vllm_tfm.drafting.draft_round import candidate_pools, draft_trees
from vllm_tfm.drafting.verifiers import verify_traversal
from vllm_tfm.vllm_glue.v2.speculator import RoundMode
from vllm_tfm.vllm_glue.v2.verify import step_seeds, verify_batch


def _fixed_drafter(spec, monkeypatch, gen) -> SimpleNamespace:
    """The drafter's forward as a function of the request: ``blocks[request]`` holds its
    DFlash states ([1 + D, WIDTH]); ``rows`` lists the request of each batch row (padded
    rows repeat the last)."""
    blocks, rows = {}, []

    def run_model(num_tokens, *args):
        states = [blocks.setdefault(request, torch.randn(spec.num_query_per_req, WIDTH,
                                                         generator=gen))
                  for request in rows]
        padded = num_tokens // spec.num_query_per_req - len(rows)
        return torch.cat(states + states[-1:] * padded)

    monkeypatch.setattr(spec, "_run_model", run_model)
    return SimpleNamespace(blocks=blocks, rows=rows)


def _propose(spec, batch, roots, temperature, seeds, hidden=None):
    """One V2 propose of ``batch`` (slots ``batch.idx_mapping``): ``roots`` [R] its bonus
    tokens, ``temperature`` / ``seeds`` [MAX] by slot (the engine's host temperatures too),
    ``hidden`` [R, width] the target's states at the rows that produced the roots."""
    slots = batch.idx_mapping.long()
    last_sampled = torch.zeros(spec.max_num_reqs, 1, dtype=torch.int64)
    last_sampled[slots, 0] = roots
    spec.engine.temperature[:] = temperature.numpy()
    if hidden is None:
        hidden = torch.zeros(batch.num_reqs, WIDTH)
    spec.engine.step = None  # h_v from each request's last row
    return spec.propose(batch, None, None, hidden, None, None, None, last_sampled, None,
                        temperature, seeds)


def _rows_batch(slots: list[int], root_positions: list[int]):
    """A decode batch of one row per request, in ``slots``."""
    n = len(slots)
    index = torch.tensor(slots, dtype=torch.int32)
    return SimpleNamespace(num_reqs=n, num_tokens=n, idx_mapping=index,
                           idx_mapping_np=index.numpy(),
                           query_start_loc=torch.arange(n + 1, dtype=torch.int32),
                           root_positions=torch.tensor(root_positions))


@pytest.mark.parametrize("tree_kind", ["ddtree", "weaver"])
@pytest.mark.parametrize("kind", ["smooth", "peaky", "zeros"])
def test_v2_sampled_trees_and_their_verifier_are_lossless(tree_kind, kind, gen, vllm_propose,
                                                          monkeypatch):
    vocab, depth, pool, budget, count = 5, 2, 3, 3, 4000
    weaver = tiny_weaver(vocab, gen) if tree_kind == "weaver" else None
    spec = _speculator(tree_kind, gen, budgets=(budget,), max_reqs=count, budget=budget,
                       depth=depth, pool=pool, vocab=vocab, weaver=weaver)
    drafter = _fixed_drafter(spec, monkeypatch, gen)
    drafter.rows[:] = [0] * count  # one request's drafter outputs on every row
    # Small states keep the marginals diffuse: a few thousand seeds draw every realisation.
    drafter.blocks[0] = torch.randn(1 + depth, WIDTH, generator=gen) / 8
    vllm_propose[0] = count
    root = int(torch.randint(0, vocab, (1,), generator=gen))
    batch = _rows_batch(list(range(count)), [17] * count)
    seeds = torch.arange(count, dtype=torch.int64) * 7919 + 3
    hidden = torch.randn(1, WIDTH, generator=gen).expand(count, -1)
    _propose(spec, batch, torch.full((count,), root), torch.ones(count), seeds, hidden)
    assert spec.round_sampling and spec.engine.trees.sampled_rows(np.arange(count)).all()

    law = ContextLaw(vocab, int(torch.randint(0, 1 << 30, (1,), generator=gen)), kind)
    realised = assert_sampled_trees_lossless(
        spec.engine.trees.gather(torch.arange(count), draws=True), law, root)

    # The verifier V2 picks for these rows is that traversal.
    probs = torch.cat([target_probs(realised.select(torch.tensor([r])), law)
                       for r in range(realised.batch_size)]).nan_to_num(1.0 / vocab)
    processed = probs.log().float()
    rows = realised.batch_size
    step_seeds = torch.arange(rows, dtype=torch.int64) + 11
    picked = verify_batch(realised, processed, np.ones(rows), np.ones(rows, dtype=bool),
                          step_seeds, "auto")
    expected = verify_traversal(realised, torch.softmax(processed, -1), step_seeds)
    assert torch.equal(picked.output_tokens, expected.output_tokens)
    assert torch.equal(picked.accepted_leaf, expected.accepted_leaf)


@pytest.mark.parametrize("tree_kind", ["ddtree", "weaver"])
def test_each_batch_runs_the_round_of_its_mode_in_that_rounds_graphs(
        tree_kind, gen, vllm_propose, draft_graph_managers, replayed_graphs,  # noqa: F811
        monkeypatch):
    """A greedy batch keeps the deterministic round, an all-sampled batch the sampled round
    (no deterministic trees grown), a mixed batch the mixed round; a request's tree is the
    same in the mixed round as in the round of its own kind."""
    spec = _speculator(tree_kind, gen)  # verify "auto": sampled trees at T > 0
    weaver = spec.weaver
    spec.init_cudagraph_manager("FULL")
    drafter = _fixed_drafter(spec, monkeypatch, gen)
    slots, roots = [4, 1, 3], torch.tensor([7, 8, 9])
    hidden = torch.randn(3, WIDTH, generator=gen)
    seeds = torch.arange(MAX_REQS, dtype=torch.int64) * 7919 + 5
    greedy, one_hot, hot = torch.zeros(MAX_REQS), torch.zeros(MAX_REQS), torch.zeros(MAX_REQS)
    one_hot[1] = 1.0
    hot[slots] = 1.0
    built = {}
    monkeypatch.setattr("vllm_tfm.vllm_glue.v2.speculator.draft_trees",
                        _recording(draft_trees, built, "draft_trees"))
    for temperature, mode in ((greedy, RoundMode.DETERMINISTIC), (one_hot, RoundMode.MIXED),
                              (hot, RoundMode.SAMPLED), (greedy, RoundMode.DETERMINISTIC)):
        drafter.rows[:] = ["a", "b", "c"]
        vllm_propose[0] = 4
        built.clear()
        _propose(spec, _rows_batch(slots, [30, 40, 50]), roots, temperature, seeds, hidden)
        assert spec.round_mode is mode and replayed_graphs[-1] is spec.round_graphs(mode)[BUDGET]
        # the sampled round grows the sampled trees alone (the mixed one calls draft_trees
        # twice, inside draft_trees_by_mask)
        assert built.get("draft_trees", 0) == (0 if mode is RoundMode.MIXED else 1)
        sampled = (temperature[slots] > 0).tolist()
        assert spec.engine.trees.sampled_rows(np.array(slots)).tolist() == sampled
        stored = spec.engine.trees.gather(torch.tensor(slots), draws=True)
        states = torch.stack([drafter.blocks[r][1:] for r in drafter.rows])
        pools = candidate_pools(spec.model.compute_logits(states), spec.options.candidate_pool)
        options = dict(weaver=weaver, h_v=hidden if weaver is not None else None,
                       dflash_hidden=states, fanout=spec.options.fanout,
                       expand_width=spec.options.expand_width_for(BUDGET))
        plain = draft_trees(tree_kind, roots, pools, BUDGET, **options)
        drawn = draft_trees(tree_kind, roots, pools, BUDGET, fixed_widths=True,
                            sample_seeds=step_seeds(seeds[slots], torch.tensor([30, 40, 50])),
                            **options)
        for row, is_sampled in enumerate(sampled):
            one = torch.tensor([row])
            _same_tree(stored.select(one), (drawn if is_sampled else plain).select(one))


def _recording(function, counts: dict, name: str):
    def recorded(*args, **kwargs):
        counts[name] = counts.get(name, 0) + 1
        return function(*args, **kwargs)
    return recorded


@pytest.mark.parametrize("tree_kind", ["weaver", "ddtree"])
def test_a_sampling_round_reads_nothing_back_from_the_device(tree_kind, gen, vllm_propose,
                                                             monkeypatch):
    spec = _speculator(tree_kind, gen)
    drafter = _fixed_drafter(spec, monkeypatch, gen)
    drafter.rows[:] = [0, 1, 2]
    vllm_propose[0] = 4
    temperature = torch.zeros(MAX_REQS)
    temperature[[2, 5]] = 1.0
    batch = _rows_batch([2, 0, 5], [11, 12, 13])
    run_as_on_cuda(monkeypatch)
    with no_host_reads():
        with pytest.raises(HostRead, match="__bool__"):
            spec.engine.trees.gather(torch.tensor([0])).validate()  # the guard is live
        _propose(spec, batch, torch.tensor([3, 4, 5]), temperature,
                 torch.arange(MAX_REQS, dtype=torch.int64), torch.randn(3, WIDTH))
    assert spec.round_sampling
    assert spec.engine.trees.sampled_rows(np.array([2, 0, 5])).tolist() == [True, False, True]
    drawn = spec.engine.trees.gather(torch.tensor([2, 5]), draws=True)
    drawn.validate(vocab_size=V)
    assert drawn.proposal_logq[:, 0].isfinite().any(-1).all()  # each root was expanded


@pytest.mark.parametrize("tree_kind", ["weaver", "ddtree"])
def test_a_seeded_requests_tree_depends_on_its_seed_and_root_position_only(tree_kind, gen,
                                                                           vllm_propose,
                                                                           monkeypatch):
    spec = _speculator(tree_kind, gen)
    drafter = _fixed_drafter(spec, monkeypatch, gen)
    hidden = {request: torch.randn(WIDTH, generator=gen) for request in "xyz"}
    seeds = torch.randint(-(1 << 62), 1 << 62, (MAX_REQS,), generator=gen)
    temperature = torch.ones(MAX_REQS)

    def tree_of_x(requests: str, slots: list[int], x_position: int, padded: int):
        """Propose ``requests`` in ``slots``; x's seed is ``seeds[0]`` wherever it sits."""
        drafter.rows[:] = list(requests)
        vllm_propose[0] = padded
        slot_seeds = seeds.clone()
        slot_seeds[slots[requests.index("x")]] = seeds[0]
        positions = [x_position if r == "x" else 60 + i for i, r in enumerate(requests)]
        _propose(spec, _rows_batch(slots, positions), torch.full((len(slots),), 9),
                 temperature, slot_seeds, torch.stack([hidden[r] for r in requests]))
        return spec.engine.trees.gather(torch.tensor([slots[requests.index("x")]]), draws=True)

    alone = tree_of_x("x", [0], 40, 1)
    among_others = tree_of_x("yzx", [3, 1, 5], 40, 4)
    _same_tree(among_others, alone)
    torch.testing.assert_close(among_others.proposal_logq, alone.proposal_logq, rtol=0,
                               atol=1e-5)
    later = tree_of_x("zx", [2, 4], 41, 2)  # the next root position: fresh draws
    assert not torch.equal(later.tokens, alone.tokens)
