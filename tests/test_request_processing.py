"""Request-level logits processing of tree nodes (vllm_tfm/vllm_glue/verify.py) against a
per-node brute force: each node sees the request's output followed by its own path."""

from types import SimpleNamespace

import pytest
import torch

from vllm.v1.sample.logits_processor.builtin import MinTokensLogitsProcessor
from vllm.v1.sample.ops.penalties import apply_all_penalties

from triton_ops.testing import random_tree_metadata
from vllm_tfm.drafting.tree import DraftTree
from vllm_tfm.vllm_glue.verify import _node_histories, apply_request_processing

VOCAB = 40


def random_trees(gen: torch.Generator, rows: int, width: int) -> DraftTree:
    meta = random_tree_metadata(gen, ["random"] * rows, width)
    tokens = torch.randint(0, VOCAB, (rows, width), generator=gen)
    return DraftTree(tokens=torch.where(meta.valid, tokens, 0), parents=meta.parents,
                     depths=meta.depths, num_nodes=meta.num_nodes,
                     draft_logq=torch.zeros(rows, width), max_depth=width)


def random_outputs(gen: torch.Generator, rows: int, max_len: int) -> list[list[int]]:
    lengths = torch.randint(1, max_len + 1, (rows,), generator=gen).tolist()
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def brute_history(tree: DraftTree, output: list[int], r: int, j: int) -> list[int]:
    path = []
    if j < int(tree.num_nodes[r]):
        while j > 0:
            path.append(int(tree.tokens[r, j]))
            j = int(tree.parents[r, j])
    return output + path[::-1]


def sampling_for(outputs, **overrides) -> SimpleNamespace:
    fields = dict(
        no_penalties=True, bad_words_token_ids={}, allowed_token_ids_mask=None,
        output_token_ids=outputs, logitsprocs=SimpleNamespace(non_argmax_invariant=[]),
    )
    fields.update(overrides)
    return SimpleNamespace(**fields)


@pytest.mark.parametrize("rows, width", [(1, 1), (1, 9), (3, 12), (4, 2)])
def test_node_histories_follow_each_path(rows, width, gen):
    tree = random_trees(gen, rows, width)
    outputs = random_outputs(gen, rows, 6)
    histories = _node_histories(outputs, tree)
    assert histories == [brute_history(tree, outputs[r], r, j)
                         for r in range(rows) for j in range(width)]


def test_penalties_mask_bad_words_and_min_tokens_match_a_per_node_brute_force(gen):
    rows, width = 3, 10
    tree = random_trees(gen, rows, width)
    outputs = random_outputs(gen, rows, 5)
    logits = torch.randn(rows, width, VOCAB, generator=gen)
    prompts = torch.randint(0, VOCAB, (rows, 7), generator=gen)
    presence = torch.rand(rows, generator=gen) * 2
    frequency = torch.rand(rows, generator=gen)
    repetition = 1 + torch.rand(rows, generator=gen)
    mask = torch.rand(rows, VOCAB, generator=gen) < 0.2
    bad_words = {1: [[int(tree.tokens[1, 0]), 3], [5]]}
    min_tokens = MinTokensLogitsProcessor.__new__(MinTokensLogitsProcessor)
    min_tokens.min_toks = {2: (len(outputs[2]) + 2, outputs[2], {7, 9}, False)}
    sampling = sampling_for(
        outputs, no_penalties=False, prompt_token_ids=prompts,
        presence_penalties=presence, frequency_penalties=frequency,
        repetition_penalties=repetition, allowed_token_ids_mask=mask,
        bad_words_token_ids=bad_words,
        logitsprocs=SimpleNamespace(non_argmax_invariant=[min_tokens]),
    )
    logits[0, 0, 0] = float("nan")  # a NaN stays a NaN: nothing hides it
    got = apply_request_processing(logits.clone(), tree, sampling)

    for r in range(rows):
        for j in range(width):
            history = brute_history(tree, outputs[r], r, j)
            want = apply_all_penalties(
                logits[r, j][None].clone(), prompts[r][None], presence[r][None],
                frequency[r][None], repetition[r][None], [history],
            )[0]
            want[mask[r]] = float("-inf")
            for word in bad_words.get(r, []):
                if history[len(history) - len(word) + 1:] == word[:-1]:
                    want[word[-1]] = float("-inf")
            if r == 2 and len(outputs[2]) + int(tree.depths[r, j]) < len(outputs[2]) + 2:
                want[[7, 9]] = float("-inf")
            torch.testing.assert_close(got[r, j], want, equal_nan=True,
                                       msg=f"node ({r}, {j})")


def test_nothing_to_apply_returns_the_logits_unchanged(gen):
    tree = random_trees(gen, 2, 5)
    logits = torch.randn(2, 5, VOCAB, generator=gen)
    out = apply_request_processing(logits, tree, sampling_for([[1], [2]]))
    assert out is logits
