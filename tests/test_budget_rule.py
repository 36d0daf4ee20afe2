"""The batch-size-aware tree budget: the rule (``options.budget_for_batch`` and its default
table), its option's validation, and losslessness in the engine while the budget changes
as the batch shrinks."""

from __future__ import annotations

import json
import os

import pytest

from vllm_tfm.options import (
    DEFAULT_COMPUTE_TOKENS,
    DEFAULT_STEP_TOKENS,
    MAX_BUDGET,
    TfmOptions,
    budget_for_batch,
    budget_levels,
    default_budget_table,
    split_speculative_config,
)

VLLM_KEYS = {"method", "model", "num_speculative_tokens"}


def split(**overrides):
    config = {"method": "dflash_tfm", "model": "drafter", "tree": "ddtree", **overrides}
    return split_speculative_config(config, VLLM_KEYS)[0]


def test_levels_are_the_powers_of_two_below_the_maximum_and_the_maximum():
    assert budget_levels(64) == (1, 2, 4, 8, 16, 32, 64)
    assert budget_levels(MAX_BUDGET) == (1, 2, 4, 8, 16, 32, 64, 127)
    assert budget_levels(7) == (1, 2, 4, 7)
    assert budget_levels(1) == (1,)


@pytest.mark.parametrize("max_budget", [1, 7, 9, 16, 33, 64, 127])
def test_default_table_fits_the_step_tokens_then_the_compute_tokens(max_budget):
    table = default_budget_table(max_budget)
    floor = 16 if max_budget >= 16 else max_budget  # the chain width of a 15-deep block
    lowest = min(floor, 8)  # DEFAULT_MIN_BUDGET, a level of every maximum from 8
    budgets = [budget_for_batch(table, batch) for batch in range(1, 65)]
    assert set(budgets) <= set(budget_levels(max_budget))
    assert budgets == sorted(budgets, reverse=True), "budgets must not grow with the batch"
    assert min(budgets) == lowest

    def fits(batch, budget):  # above the chain's width the weights-read knee, else the roof
        tokens = DEFAULT_STEP_TOKENS if budget > floor else DEFAULT_COMPUTE_TOKENS
        return batch * (1 + budget) <= tokens

    for batch, budget in enumerate(budgets, start=1):
        assert budget == lowest or fits(batch, budget), (batch, budget)
        larger = [level for level in budget_levels(max_budget) if level > budget]
        # The largest level that fits: the next one up would not.
        assert not larger or not fits(batch, larger[0]), (batch, budget)


def test_default_rule_at_the_default_budget():
    options = TfmOptions(budget=64)
    assert [options.step_budget(batch) for batch in (1, 2, 3, 8, 15, 16, 32)] == [
        64, 32, 16, 16, 16, 8, 8]
    assert options.step_budgets == (8, 16, 32, 64)


def test_a_given_table_is_kept_and_survives_the_trip_to_the_workers():
    options = split(num_speculative_tokens=64, budget_by_batch=[[1, 64], [8, 32], [32, 8]])
    assert options.budget_by_batch == ((1, 64), (8, 32), (32, 8))
    assert [options.step_budget(batch) for batch in (1, 2, 8, 9, 32, 100)] == [
        64, 32, 32, 8, 8, 8]
    assert options.step_budgets == (8, 32, 64)
    # additional_config travels as JSON-like data: lists come back for tuples.
    assert TfmOptions.from_dict(json.loads(json.dumps(options.to_dict()))) == options


def test_expand_width_follows_the_step_budget():
    assert TfmOptions(budget=64).expand_width_for(16) == 1
    assert TfmOptions(budget=64).expand_width_for(64) == 4
    assert TfmOptions(budget=64, expand_width=8).expand_width_for(4) == 4


@pytest.mark.parametrize(
    "table, message",
    [
        ([], r"must be a non-empty list of \[max running requests, budget\] pairs"),
        ("auto", r"budget_by_batch'\] must be a non-empty list"),
        ([[4]], r"budget_by_batch'\] must be a non-empty list"),
        ([[4, 16.0]], r"budget_by_batch'\] must be a non-empty list"),
        ([[0, 16]], r"max running requests ascending"),
        ([[8, 16], [8, 8]], r"max running requests ascending"),
        ([[8, 16], [4, 8]], r"max running requests ascending"),
        ([[4, 48]], r"budget 48 for batches up to 4 must be one of \[1, 2, 4, 8, 16, 32, 64\]"),
        ([[4, 128]], r"budget 128 .* must be one of \[1, 2, 4, 8, 16, 32, 64\]"),
    ],
)
def test_bad_tables_fail_naming_the_field(table, message):
    with pytest.raises(ValueError, match=message):
        split(num_speculative_tokens=64, budget_by_batch=table)


# -- in the engine -------------------------------------------------------------------

@pytest.fixture(scope="module")
def family():
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm_tfm.tiny.family import build_family

    return build_family()


@pytest.mark.engine
@pytest.mark.parametrize("tree", ["weaver", "ddtree"])
def test_greedy_stays_lossless_while_the_budget_follows_the_batch(family, tree, monkeypatch):
    """4 requests of 8, 16, 24 and 32 new tokens: the batch shrinks 4 -> 1 and the rule
    moves the budget 2 -> 4 -> 8, each step's trees grown by the draft round of its batch
    bucket (1, 2, 4) and budget; every output equals no speculation (up to bf16 ties)."""
    from vllm import SamplingParams

    from vllm_tfm.drafting.draft_round import DraftRound
    from vllm_tfm.tiny.engine_runs import PROMPTS, compare_greedy, cpu_engine, engine_greedy
    from vllm_tfm.vllm_glue import proposer

    prompts = list(PROMPTS[:4])
    lengths = [8, 16, 24, 32]
    baseline = engine_greedy(family.target, None, tuple(prompts), max_tokens=max(lengths))
    seen: set[tuple[int, int]] = set()
    grow = proposer.TreeProposer._grow_trees

    def recording(self, root_tokens, sampled, seeds, budget):
        seen.add((root_tokens.shape[0], budget))
        return grow(self, root_tokens, sampled, seeds, budget)

    monkeypatch.setattr(proposer.TreeProposer, "_grow_trees", recording)
    # Every step's trees come from the draft round of its bucket (vllm_glue/draft_graphs.py).
    rounds: set[tuple[int, int, int]] = set()
    call = DraftRound.__call__

    def replay(self, root_tokens, *args, **kwargs):
        rounds.add((root_tokens.shape[0], self.budget, self.batch))
        return call(self, root_tokens, *args, **kwargs)

    monkeypatch.setattr(DraftRound, "__call__", replay)
    config = {"method": "dflash_tfm", "model": str(family.dflash), "tree": tree,
              "num_speculative_tokens": 8, "budget_by_batch": [[1, 8], [2, 4], [4, 2]]}
    if tree == "weaver":
        config["weaver"] = str(family.weaver)
    llm = cpu_engine(family.target, config, max_num_seqs=4)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    del llm
    tokens = [list(output.outputs[0].token_ids) for output in outputs]
    assert [len(t) for t in tokens] == lengths
    base = {"tokens": [t[:n] for t, n in zip(baseline["tokens"], lengths)],
            "margins": [m[:n] for m, n in zip(baseline["margins"], lengths)]}
    for prompt, row in enumerate(compare_greedy(base, {"tokens": tokens})):
        assert row["matched"] == row["length"] or row["tie"], (
            f"prompt {prompt}: differs at token {row['matched']}, top-2 margin "
            f"{row.get('margin')} (not a bf16 tie)")
    budgets = {budget for _, budget in seen}
    assert budgets == {2, 4, 8}, f"(batch, budget) drafted: {sorted(seen)}"
    assert all(budget == {1: 8, 2: 4}.get(batch, 2) for batch, budget in seen), sorted(seen)
    assert rounds == {(batch, budget, {3: 4}.get(batch, batch)) for batch, budget in seen}, (
        sorted(rounds))
