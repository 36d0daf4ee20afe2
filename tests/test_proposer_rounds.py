"""The tree proposer's draft rounds (vllm_glue/draft_graphs.py), on CPU: which rounds it
builds (batch buckets x the budgets the rule picks), that a step runs the round of its
bucket and budget and grows draft_trees' very trees for batches smaller than the bucket,
and that sampled-children rows, grammar-constrained rounds and unbuilt shapes take
draft_trees as before. Off CUDA the rounds run their static buffers eagerly: the same
buffers a CUDA graph replays."""

from __future__ import annotations

import zlib
from types import SimpleNamespace

import pytest
import torch

from vllm_tfm.drafting.draft_round import (
    CandidatePools,
    DraftRound,
    draft_trees,
    draft_trees_per_request,
)
from vllm_tfm.drafting.weaver import WeaverConfig
from vllm_tfm.drafting.weaver_checkpoint import random_weaver
from vllm_tfm.options import MAX_BATCH, TfmOptions
from vllm_tfm.vllm_glue import proposer as proposer_module
from vllm_tfm.vllm_glue.draft_graphs import DraftRounds, batch_buckets, bucket_for, round_shapes
from vllm_tfm.vllm_glue.proposer import TreeProposer

V, D, P, WIDTH, MAX_SEQS = 60, 6, 16, 32, 6


def test_buckets_are_powers_of_two_and_max_num_seqs():
    assert batch_buckets(1) == (1,)
    assert batch_buckets(6) == (1, 2, 4, 6)
    assert batch_buckets(32) == (1, 2, 4, 8, 16, 32)
    assert [bucket_for((1, 2, 4, 6), n) for n in (1, 2, 3, 5, 6, 7)] == [1, 2, 4, 6, 6, None]
    with pytest.raises(ValueError, match="max_batch must be a positive int"):
        batch_buckets(0)


def test_rounds_cover_the_pairs_the_budget_rule_picks():
    # Default rule at 64: batch 1 -> 64, 2 -> 32, more -> 16.
    assert round_shapes(TfmOptions(budget=64), batch_buckets(8)) == [
        (16, 4), (16, 8), (32, 2), (64, 1)]
    one_budget = TfmOptions(budget=64, budget_by_batch=((MAX_BATCH, 33),))
    assert round_shapes(one_budget, batch_buckets(6)) == [(33, 1), (33, 2), (33, 4), (33, 6)]


def _weaver(seed):
    config = WeaverConfig(d_model=WIDTH, d_embed=24, d_rank=16, num_layers=1, num_heads=2,
                          mlp_dim=20, K=15, candidate_pool_size=P)
    weaver = random_weaver(config, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    weaver.prepare_tables(torch.randn(V, 24, generator=gen), torch.randn(V, WIDTH, generator=gen))
    return weaver


def _proposer(options, weaver, monkeypatch, rank=0):
    """A TreeProposer holding what _grow_trees and prepare_rounds read (no engine)."""
    monkeypatch.setattr(proposer_module, "get_tp_group",
                        lambda: SimpleNamespace(rank_in_group=rank, world_size=1))
    proposer = TreeProposer.__new__(TreeProposer)
    proposer.options, proposer.weaver, proposer.device = options, weaver, torch.device("cpu")
    proposer.vllm_config = SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_seqs=MAX_SEQS))
    proposer.draft_depth = D
    proposer._rounds, proposer._step_tokens, proposer._grammars = None, None, None
    return proposer


def _step(proposer, gen, n):
    """This step's drafter outputs for ``n`` requests; the root tokens."""
    logits = torch.randn(n, D, V, generator=gen) * 3
    proposer._pools = CandidatePools(*reversed(torch.topk(logits, P, dim=-1)))
    proposer._target_hidden = torch.randn(n, WIDTH, generator=gen)
    proposer._dflash_hidden = torch.randn(n, D, WIDTH, generator=gen)
    return torch.randint(0, V, (n,), generator=gen)


def _eager(proposer, roots, budget, **extra):
    return draft_trees(proposer.options.tree, roots, proposer._pools, budget,
                       weaver=proposer.weaver, h_v=proposer._target_hidden,
                       dflash_hidden=proposer._dflash_hidden, fanout=proposer.options.fanout,
                       expand_width=proposer.options.expand_width_for(budget), **extra)


def _same_tree(got, want):
    """Same nodes exactly; path scores to float rounding (a bucket's Weaver runs more rows,
    so its matmuls may round differently: test_draft_round.py allows the same 1e-5)."""
    for field in ("num_nodes", "tokens", "parents", "depths"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field
    error = (got.draft_logq - want.draft_logq).abs().nan_to_num().max().item()
    print(f"draft_logq max difference {error:.2e}")
    assert error <= 1e-5
    assert torch.equal(got.draft_logq.isinf(), want.draft_logq.isinf())
    assert got.max_depth == want.max_depth


@pytest.fixture
def replays(monkeypatch):
    """(tree, bucket, budget) of every round call."""
    calls = []
    call = DraftRound.__call__

    def spy(self, root_tokens, *args, **kwargs):
        calls.append((self.tree, self.batch, self.budget))
        return call(self, root_tokens, *args, **kwargs)

    monkeypatch.setattr(DraftRound, "__call__", spy)
    return calls


@pytest.mark.parametrize("tree", ["weaver", "ddtree", "chain"])
def test_steps_run_their_bucket_and_budget_and_grow_draft_trees_trees(tree, monkeypatch,
                                                                      replays):
    """Default rule at budget 16 (one row: every batch 16) and a two-row table; batches
    3, 5, 1, 6, 2: buckets 4, 6, 1, 6, 2, the stale rows of a bucket left from earlier
    calls."""
    seed = zlib.crc32(tree.encode())
    weaver = _weaver(seed) if tree == "weaver" else None
    options = TfmOptions(budget=16, tree=tree, candidate_pool=P,
                         budget_by_batch=((2, 16), (MAX_BATCH, 8)))
    proposer = _proposer(options, weaver, monkeypatch)
    assert proposer.prepare_rounds() == 0
    assert proposer.num_rounds == 4  # (16, 1), (16, 2), (8, 4), (8, 6)
    gen = torch.Generator().manual_seed(seed)
    for n in (3, 5, 1, 6, 2):
        roots = _step(proposer, gen, n)
        budget = options.step_budget(n)
        got = proposer._grow_trees(roots, [False] * n, None, budget)
        assert replays[-1] == (tree, bucket_for(batch_buckets(MAX_SEQS), n), budget)
        _same_tree(got, _eager(proposer, roots, budget, validate=False))
    assert len(replays) == 5


def test_a_tree_kind_switch_builds_its_rounds_and_keeps_the_others(monkeypatch, replays):
    options = TfmOptions(budget=16, tree="weaver", candidate_pool=P,
                         budget_by_batch=((MAX_BATCH, 16),))
    proposer = _proposer(options, _weaver(3), monkeypatch)
    proposer.prepare_rounds()
    assert proposer.num_rounds == 4
    proposer.options = TfmOptions(budget=16, tree="ddtree", candidate_pool=P,
                                  budget_by_batch=((MAX_BATCH, 8),))
    proposer.prepare_rounds()
    proposer.prepare_rounds()  # built ones are kept, not rebuilt
    assert proposer.num_rounds == 8
    proposer.prepare_rounds("chain")
    assert proposer.num_rounds == 12
    gen = torch.Generator().manual_seed(3)
    roots = _step(proposer, gen, 3)
    _same_tree(proposer._grow_trees(roots, [False] * 3, None, 8),
               _eager(proposer, roots, 8, validate=False))
    assert replays == [("ddtree", 4, 8)]


def test_ranks_that_do_not_grow_trees_build_no_rounds(monkeypatch):
    proposer = _proposer(TfmOptions(budget=16, tree="ddtree", candidate_pool=P), None,
                         monkeypatch, rank=1)
    assert proposer.prepare_rounds() == 0
    assert proposer.num_rounds == 0


class _EvenTokens:
    """A grammar stand-in: children may take even tokens only."""

    def child_bitmask(self, tokens, parents, nodes):
        words = -(-V // 32)
        even = torch.tensor(sum(1 << bit for bit in range(0, 32, 2)), dtype=torch.int32)
        return even.expand(*nodes.shape, words).clone()


@pytest.mark.parametrize("tree", ["weaver", "ddtree"])
def test_sampled_rows_grammars_and_unbuilt_shapes_take_draft_trees(tree, monkeypatch,
                                                                    replays):
    weaver = _weaver(5) if tree == "weaver" else None
    options = TfmOptions(budget=16, tree=tree, candidate_pool=P,
                         budget_by_batch=((MAX_BATCH, 16),))
    proposer = _proposer(options, weaver, monkeypatch)
    proposer.prepare_rounds()
    gen = torch.Generator().manual_seed(5)
    roots = _step(proposer, gen, 3)

    sampled, seeds = [False, True, False], torch.tensor([11, 12, 13])
    got = proposer._grow_trees(roots, sampled, seeds, 16)
    want = draft_trees_per_request(
        tree, roots, proposer._pools, 16, sampled, seeds, weaver=weaver,
        h_v=proposer._target_hidden, dflash_hidden=proposer._dflash_hidden,
        fanout=options.fanout, expand_width=options.expand_width_for(16), validate=False)
    _same_tree(got, want)
    assert torch.equal(got.proposal_logq, want.proposal_logq)

    proposer._grammar_constraint = lambda batch: _EvenTokens()
    got = proposer._grow_trees(roots, [False] * 3, None, 16)
    _same_tree(got, _eager(proposer, roots, 16, validate=False, constraint=_EvenTokens()))
    assert (got.tokens[:, 1:][got.parents[:, 1:] >= 0] % 2 == 0).all()
    del proposer._grammar_constraint

    # Budget 8 was never built (the rule picks 16): eager, the same trees.
    roots = _step(proposer, gen, 2)
    _same_tree(proposer._grow_trees(roots, [False] * 2, None, 8),
               _eager(proposer, roots, 8, validate=False))
    assert replays == []


def test_the_capture_patch_captures_rounds_after_vllms_graphs_for_dflash_tfm_only():
    from vllm.config import CUDAGraphMode

    from vllm_tfm.vllm_glue.draft_graphs import wrap_capture_model

    order = []

    class Drafter:
        num_rounds = 3

        def prepare_rounds(self):
            order.append("rounds")
            return 7

    def capture_model(runner):
        order.append("vllm")
        return 5

    capture = wrap_capture_model(capture_model)

    def runner(tfm: bool, mode=CUDAGraphMode.FULL_AND_PIECEWISE):
        return SimpleNamespace(_tfm_options=TfmOptions() if tfm else None, drafter=Drafter(),
                               compilation_config=SimpleNamespace(cudagraph_mode=mode))

    assert capture(runner(True)) == 12 and order == ["vllm", "rounds"]
    order.clear()
    assert capture(runner(False)) == 5 and order == ["vllm"]
    order.clear()
    # No CUDA graphs configured: vLLM captures nothing, nor do the rounds (eager drafting).
    assert capture(runner(True, CUDAGraphMode.NONE)) == 5 and order == ["vllm"]
