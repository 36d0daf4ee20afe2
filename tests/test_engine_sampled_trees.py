"""Which requests of a batch get sampled trees, and how each request is verified.

The rule (``verify.sampled_tree_requests``) and the per-request dispatch of
``verify.verify_trees`` in a batch mixing greedy requests, sampled requests on
sampled trees and sampled requests on deterministic trees: every request's
result is the one its own verifier gives it alone. The engine's chi-square test
against no speculation (tests/test_engine.py) runs the same path end to end.
"""

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_tfm.drafting.draft_round import CandidatePools, draft_trees_per_request
from vllm_tfm.drafting.verifiers import verify_greedy, verify_target_only, verify_traversal
from vllm_tfm.options import AUTO_SAMPLED_TREE_MIN_TEMPERATURE, TfmOptions
from vllm_tfm.vllm_glue import verify as engine_verify
from vllm_tfm.vllm_glue.verify import sampled_tree_requests, verify_trees


def sampling(temperatures):
    return SimpleNamespace(all_greedy=all(t == 0 for t in temperatures),
                           temperature=torch.tensor(temperatures))


@pytest.mark.parametrize("tree,verify,expected", [
    ("weaver", "auto", [False, False, True, True]),
    ("ddtree", "auto", [False, True, True, True]),
    ("chain", "auto", [False] * 4),
    ("weaver", "traversal", [False, True, True, True]),
    ("ddtree", "traversal", [False, True, True, True]),
    ("chain", "traversal", [False] * 4),
    ("weaver", "target_only", [False] * 4),
    ("ddtree", "greedy", [False] * 4),
])
def test_which_requests_get_sampled_trees(tree, verify, expected):
    weaver_lowest = AUTO_SAMPLED_TREE_MIN_TEMPERATURE["weaver"]
    assert AUTO_SAMPLED_TREE_MIN_TEMPERATURE["ddtree"] == 0.0
    temperatures = [0.0, weaver_lowest / 2, weaver_lowest, 1.3]
    options = TfmOptions(tree=tree, verify=verify)
    assert sampled_tree_requests(options, sampling(temperatures), 4) == expected
    assert sampled_tree_requests(options, sampling([0.0] * 4), 4) == [False] * 4
    assert sampled_tree_requests(options, None, 2) == [False] * 2


@pytest.mark.parametrize("scratch", [False, True])
@pytest.mark.parametrize("mode", ["auto", "target_only", "traversal"])
def test_each_request_takes_its_own_verifier(mode, scratch, gen, monkeypatch):
    # scratch: model runner V2's call, one float32 tensor for both, turned into the
    # probabilities in place, two rows at a time here.
    monkeypatch.setattr(engine_verify, "SOFTMAX_CHUNK_BYTES", 2 * 4 * 9)
    R, D, P, V, budget = 6, 3, 4, 9, 7
    ids = torch.stack([torch.stack([torch.randperm(V, generator=gen)[:P] for _ in range(D)])
                       for _ in range(R)])
    pools = CandidatePools(ids, torch.randn(R, D, P, generator=gen))
    roots = torch.randint(0, V, (R,), generator=gen)
    sampled = [False, True, False, True, False, True]
    is_greedy = np.array([True, False, False, False, True, False])
    seeds = torch.arange(R, dtype=torch.int64) * 13 + 1
    tree = draft_trees_per_request("ddtree", roots, pools, budget, sampled, seeds + 5)
    logits = torch.randn(R, budget + 1, V, generator=gen, dtype=torch.float64).float()
    probs = torch.softmax(logits, -1)
    work = logits.clone()
    result = verify_trees(tree, work, work, is_greedy, np.array(sampled), seeds, mode,
                          scratch=scratch)
    assert torch.equal(work, probs if scratch else logits)
    plain = replace(tree, pool_ids=None, proposal_logq=None)
    deterministic = verify_traversal if mode == "traversal" else verify_target_only
    for r in range(R):
        if is_greedy[r]:
            want = verify_greedy(plain, logits)
        elif sampled[r]:
            want = verify_traversal(tree, probs, seeds)
        else:
            want = deterministic(plain, probs, seeds)
        for name in ("accepted_leaf", "path", "bonus_token", "output_tokens"):
            assert torch.equal(getattr(result, name)[r], getattr(want, name)[r]), (r, name)
