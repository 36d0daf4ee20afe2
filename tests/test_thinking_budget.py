"""Thinking budgets under dflash_tfm: every tree node is forced as plain decoding forces
the token after that node's path.

The reference is vLLM's own ThinkingBudgetStateHolder of an engine without speculation,
driven through its public calls one decoding step at a time along each root-to-node
path; the tree holder must agree with it on every node of random trees, for single- and
multi-token reasoning strings, prompts that open a thinking section or not, every budget
from 0 up, across several committed steps. In the engine, requests with thinking budgets
give the tokens of decoding without speculation (greedy) and the same distribution
(sampled, chi-square), beside requests without budgets.
"""

from __future__ import annotations

import gc
import os
import random
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from vllm.v1.sample.thinking_budget_state import ThinkingBudgetStateHolder  # noqa: E402

from vllm_tfm.vllm_glue.thinking import FORCED_LOGIT, TreeThinkingBudgets  # noqa: E402

VOCAB = 6
# (start ids, end ids): one-token strings (a tokenizer with think tokens) and
# multi-token ones (the tiny family's tokenizer, which has none).
REASONING = {"single": ([1], [3]), "multi": ([1, 2], [3, 4]), "long_end": ([1], [3, 4, 5])}


def reasoning_config(start, end):
    return SimpleNamespace(reasoning_start_token_ids=list(start),
                           reasoning_end_token_ids=list(end))


def batch_update(added=(), removed=(), moved=()):
    return SimpleNamespace(added=list(added), removed=list(removed), moved=list(moved))


def plain_decoding_forcing(start, end, prompt, budget, tokens) -> list[int | None]:
    """Per k = 0 .. len(tokens): the token an engine without speculation forces as output
    token k when its output so far is tokens[:k] (vLLM's holder, its own calls)."""
    holder = ThinkingBudgetStateHolder(reasoning_config(start, end), 4, 0, torch.device("cpu"),
                                       False)
    output: list[int] = []
    holder.sync_batch(batch_update(added=[(0, SimpleNamespace(thinking_token_budget=budget),
                                           list(prompt), output)]))
    forced = []
    for k in range(len(tokens) + 1):
        output[:] = tokens[:k]
        holder.update_state([list(output)], [[]])
        logits = holder.apply_to_logits(torch.zeros(1, VOCAB), False, [[]])
        top = int(logits[0].argmax())
        forced.append(top if float(logits[0, top]) == FORCED_LOGIT else None)
    return forced


def tree_holder(start, end):
    vllm_holder = ThinkingBudgetStateHolder(reasoning_config(start, end), 4, 7,
                                            torch.device("cpu"), False)
    return TreeThinkingBudgets.replacing(vllm_holder)


def random_tree(gen: random.Random, count: int, forced_bias: list[int]):
    """Parents (topological) and tokens of ``count`` nodes; node 0 is the root."""
    parents, tokens = [-1], [0]
    for node in range(1, count):
        parents.append(gen.randrange(node))
        tokens.append(gen.choice(forced_bias) if gen.random() < 0.4 else gen.randrange(VOCAB))
    return parents, tokens


def depths_of(parents):
    depths = [0]
    for node in range(1, len(parents)):
        depths.append(depths[parents[node]] + 1)
    return depths


def path_tokens(parents, tokens, node):
    path = []
    while node > 0:
        path.append(tokens[node])
        node = parents[node]
    return path[::-1]


PROMPTS = {
    "thinking": [0, 5, 1, 2],  # ends inside a thinking section (for both start strings)
    "thought": [1, 2, 0, 3, 4, 5],  # a closed section
    "plain": [0, 5, 0],
    "deep": [1, 2, 0, 0, 0, 5, 0],  # inside, with thinking tokens already spent
}


@pytest.mark.parametrize("reasoning", list(REASONING))
@pytest.mark.parametrize("prompt", list(PROMPTS))
def test_every_node_is_forced_as_plain_decoding_forces_its_path(reasoning, prompt):
    start, end = REASONING[reasoning]
    gen = random.Random(f"{reasoning}-{prompt}")
    checked = forced_nodes = 0
    for budget in range(0, 6):
        for _ in range(6):
            holder = tree_holder(start, end)
            output: list[int] = []
            holder.sync_batch(batch_update(added=[
                (0, SimpleNamespace(thinking_token_budget=budget), list(PROMPTS[prompt]),
                 output)]))
            committed: list[int] = []
            for _step in range(4):  # commit a path per step, as verification does
                parents, tokens = random_tree(gen, gen.randrange(1, 14), start + end)
                tokens[0] = committed[-1] if committed else 0
                output[:] = committed
                got = holder.node_forcing(holder._tracked[0], tokens, parents,
                                          depths_of(parents), len(parents))
                for node in range(len(parents)):
                    history = committed + path_tokens(parents, tokens, node)
                    expected = plain_decoding_forcing(start, end, PROMPTS[prompt], budget,
                                                      history)[-1]
                    assert got[node] == expected, (budget, committed, history, node)
                    checked += 1
                    forced_nodes += expected is not None
                # Accept a random path, then one more token (the bonus): forced if due.
                leaf = gen.randrange(len(parents))
                bonus = got[leaf] if got[leaf] is not None else gen.randrange(VOCAB)
                committed = committed + path_tokens(parents, tokens, leaf) + [bonus]
    assert checked > 500 and forced_nodes >= 10, (checked, forced_nodes)


def test_rows_of_vllms_samplers_get_the_committed_forcing():
    """Rows vLLM's own sampler sees under dflash_tfm (one per request): request i's row is
    forced as plain decoding would force it; a request without a budget is not."""
    start, end = REASONING["single"]
    holder = tree_holder(start, end)
    first, second = [0, 0, 0], [0, 0, 0]
    holder.sync_batch(batch_update(added=[
        (0, SimpleNamespace(thinking_token_budget=2), [1], first),
        (1, SimpleNamespace(thinking_token_budget=None), [1], second),
    ]))
    logits = holder.apply_to_logits(torch.zeros(2, VOCAB), True, None)
    assert float(logits[0, 3]) == FORCED_LOGIT and float(logits[0].sum()) == FORCED_LOGIT
    assert float(logits[1].abs().sum()) == 0.0
    assert plain_decoding_forcing(start, end, [1], 2, first)[-1] == 3
    # Moved to another row (the batch condensed): the state moves with it.
    holder.sync_batch(batch_update(removed=[1], moved=[(0, 1, None)]))
    logits = holder.apply_to_logits(torch.zeros(2, VOCAB), False, None)
    assert float(logits[1, 3]) == FORCED_LOGIT and float(logits[0].abs().sum()) == 0.0


def test_forced_rows_of_a_tree_batch():
    """force_tree_rows writes FORCED_LOGIT at each forced node's token, row r * N + j, and
    touches nothing else: not request 0 (no budget), not padding past a tree's end."""
    from vllm_tfm.drafting.tree import DraftTree

    start, end = REASONING["multi"]
    prompt, budget = [1, 2, 0], 2
    holder = tree_holder(start, end)
    output = [0]
    holder.sync_batch(batch_update(added=[(1, SimpleNamespace(thinking_token_budget=budget),
                                           prompt, output)]))
    parents = [[-1, 0, -1, -1, -1], [-1, 0, 1, 0, 3]]
    tokens = [[5, 2, 0, 0, 0], [0, 5, 3, 3, 0]]
    depths = [[0, 1, 0, 0, 0], [0, 1, 2, 1, 2]]
    tree = DraftTree(tokens=torch.tensor(tokens), parents=torch.tensor(parents, dtype=torch.int32),
                     depths=torch.tensor(depths, dtype=torch.int32),
                     num_nodes=torch.tensor([2, 5], dtype=torch.int32),
                     draft_logq=torch.zeros(2, 5), max_depth=4)
    expected = set()
    for node in range(5):
        history = output + path_tokens(parents[1], tokens[1], node)
        token = plain_decoding_forcing(start, end, prompt, budget, history)[-1]
        if token is not None:
            expected.add((1, node, token))
    assert 0 < len(expected) < 5, expected
    logits = holder.force_tree_rows(torch.zeros(2, 5, VOCAB), tree)
    forced = {(r, j, t) for r, j, t in (logits == FORCED_LOGIT).nonzero().tolist()}
    assert forced == expected
    assert int((logits != 0).sum()) == len(expected)


# --- In the engine -----------------------------------------------------------------------

# A reasoning config without a parser: vLLM tokenizes both strings (the tiny family's
# tokenizer has no think tokens, so each is several tokens: forcing spans several steps).
ENGINE_REASONING = {"reasoning_start_str": "<think>", "reasoning_end_str": "</think>"}
PROMPT = "def fibonacci(n):\n"
THINKING = PROMPT + "<think>"
SPENT = PROMPT + "<think>compute it in a loop"  # budget partly spent in the prompt
# (prompt, thinking_token_budget) of one mixed batch: budgets from 0 (the end string
# from the first token on) to past max_tokens (never forced), requests without budgets
# beside them, one whose prompt never opens a thinking section.
GREEDY_BATCH = (
    (THINKING, 0), (THINKING, 3), (THINKING, 9), (THINKING, 100), (THINKING, None),
    (SPENT, 4), (SPENT, 12), (PROMPT, 2), (PROMPT, None),
)
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def trained():
    from vllm_tfm.tiny.family import trained_family

    return trained_family()


@pytest.fixture(scope="module")
def end_ids(trained):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(trained.target / "tokenizer.json"))
    ids = tokenizer.encode(ENGINE_REASONING["reasoning_end_str"], add_special_tokens=False).ids
    assert len(ids) > 1, ids
    return ids


def tfm_config(family, tree="weaver", budget=16, **extra):
    from test_engine import tfm_config as engine_config

    return engine_config(family, tree, budget=budget, **extra)


def greedy_batch(family, speculative_config) -> dict:
    from vllm import SamplingParams

    from vllm_tfm.tiny.engine_runs import cpu_engine, spec_counters, top2_margins

    llm = cpu_engine(family.target, speculative_config, max_num_seqs=len(GREEDY_BATCH),
                     reasoning_config=ENGINE_REASONING, disable_log_stats=False)
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=2,
                             thinking_token_budget=budget) for _, budget in GREEDY_BATCH]
    outputs = [o.outputs[0] for o in llm.generate([p for p, _ in GREEDY_BATCH], params,
                                                    use_tqdm=False)]
    counters = spec_counters(llm) if speculative_config is not None else (0, 0)
    del llm  # before the next engine starts: its teardown resets global state
    gc.collect()
    return {"tokens": [list(o.token_ids) for o in outputs],
            "margins": [top2_margins(o.logprobs) for o in outputs], "counters": counters}


def end_position(tokens: list[int], end: list[int]) -> int | None:
    return next((i for i in range(len(tokens)) if tokens[i:i + len(end)] == end), None)


@pytest.fixture(scope="module")
def no_speculation(trained, end_ids):
    result = greedy_batch(trained, None)
    # The batch exercises the budgets: each one the output reaches forces the end string,
    # later for a larger budget (vLLM 0.32 counts a multi-token start string that ends the
    # prompt short by its length - 1: the end comes that much later than the budget); a
    # budget the output never reaches leaves it as it is without one.
    free = result["tokens"][GREEDY_BATCH.index((THINKING, None))]
    assert end_position(free, end_ids) is None
    positions = {}
    for (prompt, budget), tokens in zip(GREEDY_BATCH, result["tokens"]):
        if prompt != PROMPT and budget is not None and budget < MAX_TOKENS:
            positions[prompt, budget] = end_position(tokens, end_ids)
            assert positions[prompt, budget] is not None, (prompt, budget, tokens)
        if budget == 100:
            assert tokens == free
    assert positions[THINKING, 0] < positions[THINKING, 3] < positions[THINKING, 9]
    assert positions[SPENT, 4] < positions[SPENT, 12]
    return result


def count_forcing(monkeypatch, seen: Counter) -> None:
    """Count tree rows forced, and verification fallbacks (``verify.sample_roots``: exact,
    but trees unverified, so a test of trees must see none)."""
    from vllm_tfm.vllm_glue import thinking, verify

    force = thinking.TreeThinkingBudgets.force_tree_rows
    sample_roots = verify.sample_roots

    def forced(self, node_logits, tree):
        result = force(self, node_logits, tree)
        seen["forced_rows"] += int((result == thinking.FORCED_LOGIT).sum())
        return result

    def fallback(*args):
        seen["fallbacks"] += 1
        return sample_roots(*args)

    monkeypatch.setattr(thinking.TreeThinkingBudgets, "force_tree_rows", forced)
    monkeypatch.setattr(verify, "sample_roots", fallback)


@pytest.mark.engine
@pytest.mark.parametrize("tree", ["weaver", "chain", "ddtree"])
def test_greedy_with_thinking_budgets_equals_no_speculation(trained, no_speculation, tree,
                                                            monkeypatch):
    """The mixed batch under dflash_tfm: every request's tokens equal decoding without
    speculation (up to bf16 ties), with end strings forced inside verified trees."""
    from vllm_tfm.tiny.engine_runs import compare_greedy

    seen = Counter()
    count_forcing(monkeypatch, seen)
    result = greedy_batch(trained, tfm_config(trained, tree))
    for request, row in zip(GREEDY_BATCH, compare_greedy(no_speculation, result)):
        if row["matched"] < row["length"]:
            assert row["tie"], (request, row, result["tokens"], no_speculation["tokens"])
    drafts, accepted = result["counters"]
    assert seen["fallbacks"] == 0, "a tree step fell back to sampling its roots"
    assert seen["forced_rows"] > 0 and drafts > 0 and accepted > 0, (dict(seen), drafts,
                                                                      accepted)


def sampled_categories(llm, count: int, end: list[int]) -> list[tuple]:
    """``count`` seeded T = 1 samples of THINKING, every third without a budget: per
    budgeted sample, where the end string starts and the token drawn after it (from the
    target at a node below the forced ones); per other sample its first two tokens."""
    from vllm import SamplingParams

    params = [SamplingParams(temperature=1.0, seed=500 + i, max_tokens=14,
                             thinking_token_budget=None if i % 3 == 0 else 2)
              for i in range(count)]
    outputs = llm.generate([THINKING] * count, params, use_tqdm=False)
    categories = []
    for i, output in enumerate(outputs):
        tokens = list(output.outputs[0].token_ids)
        if i % 3 == 0:
            categories.append(("free", *tokens[:2]))
            continue
        at = end_position(tokens, end)
        after = tokens[at + len(end)] if at is not None and at + len(end) < len(tokens) else None
        categories.append(("budget", at, after))
    return categories


@pytest.mark.engine
def test_sampling_with_thinking_budgets_follows_no_speculation(trained, end_ids, monkeypatch):
    """T = 1 (sampled Weaver trees, traversal): budgeted and unbudgeted requests in one
    batch follow decoding without speculation (chi-square); every budgeted sample has its
    end string, forced inside trees; seeded requests reproduce."""
    from test_engine import _chi_square_p_value

    from vllm_tfm.tiny.engine_runs import cpu_engine

    count = 240
    llm = cpu_engine(trained.target, None, max_num_seqs=64, reasoning_config=ENGINE_REASONING)
    reference = sampled_categories(llm, count, end_ids)
    del llm
    gc.collect()
    seen = Counter()
    count_forcing(monkeypatch, seen)
    # One budget at every batch size: the default rule drafts 8-node trees from 16 running
    # requests on, and a seeded request reproduces under the same budgets only.
    llm = cpu_engine(trained.target, tfm_config(trained, budget_by_batch=[[1 << 20, 16]]),
                     max_num_seqs=64, reasoning_config=ENGINE_REASONING)
    speculative = sampled_categories(llm, count, end_ids)
    again = sampled_categories(llm, count // 4, end_ids)
    del llm
    gc.collect()
    for categories in (reference, speculative):
        assert not any(key[0] == "budget" and key[1] is None for key in categories), categories
    assert seen["forced_rows"] > 0 and seen["fallbacks"] == 0, dict(seen)
    assert again == speculative[: count // 4], "seeded sampling must be reproducible"
    reference, speculative = Counter(reference), Counter(speculative)
    assert _chi_square_p_value(reference, speculative) > 1e-3, (reference, speculative)
