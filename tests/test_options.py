"""The dflash_tfm options: defaults, translation to vLLM's dflash, and every rejection."""

import pytest

from vllm_tfm.options import (
    DEFAULT_BUDGET,
    MAX_BUDGET,
    TfmOptions,
    resolve_candidate_pool,
    split_speculative_config,
)

VLLM_KEYS = {"method", "model", "num_speculative_tokens", "draft_tensor_parallel_size"}


def split(tmp_path, **overrides):
    weaver = tmp_path / "weaver.pth"
    weaver.write_bytes(b"")
    config = {"method": "dflash_tfm", "model": "drafter", "weaver": str(weaver), **overrides}
    return split_speculative_config({k: v for k, v in config.items() if v is not None}, VLLM_KEYS)


def test_defaults_and_translation(tmp_path):
    options, vllm_config = split(tmp_path)
    assert options.budget == DEFAULT_BUDGET
    assert (options.tree, options.verify, options.fanout, options.candidate_pool) == (
        "weaver", "auto", 8, None)
    assert options.resolved_expand_width == 4  # ceil(64 / 16)
    assert vllm_config == {"method": "dflash", "model": "drafter",
                           "num_speculative_tokens": DEFAULT_BUDGET}
    assert TfmOptions.from_dict(options.to_dict()) == options


def test_baseline_trees_need_no_weaver(tmp_path):
    options, _ = split(tmp_path, tree="ddtree", weaver=None, num_speculative_tokens=7)
    assert (options.tree, options.weaver, options.budget) == ("ddtree", None, 7)
    assert options.resolved_expand_width == 1


def test_dashed_keys_are_accepted(tmp_path):
    options, _ = split_speculative_config(
        {"method": "dflash_tfm", "model": "m", "tree": "chain", "candidate-pool": 16},
        VLLM_KEYS,
    )
    assert options.candidate_pool == 16


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"bogus": 1}, r"unknown speculative_config key\(s\) \['bogus'\]"),
        ({"model": None}, r"speculative_config\['model'\]"),
        ({"num_speculative_tokens": 0}, r"num_speculative_tokens'\] must be in \[1, 127\]"),
        ({"num_speculative_tokens": MAX_BUDGET + 1}, r"num_speculative_tokens"),
        ({"num_speculative_tokens": "8"}, r"num_speculative_tokens'\] must be an integer"),
        ({"tree": "beam"}, r"tree'\] must be one of \['weaver', 'ddtree', 'chain'\]"),
        ({"verify": "strict"}, r"verify'\] must be one of"),
        ({"weaver": None}, r"speculative_config\['weaver'\] is required"),
        ({"weaver": "/no/such/weaver.pth"}, r"weaver'\] = '/no/such/weaver.pth' does not exist"),
        ({"fanout": 0}, r"fanout'\] must be in"),
        ({"fanout": 600, "candidate_pool": 512}, r"fanout'\] must be in \[1, 512\]"),
        ({"expand_width": 33}, r"expand_width'\] must be in \[1, 32\]"),
        ({"candidate_pool": True}, r"candidate_pool'\] must be an integer"),
    ],
)
def test_bad_options_name_the_field(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        split(tmp_path, **overrides)


@pytest.mark.parametrize(
    "tree, explicit, vocab, weaver_pool, expected",
    [
        ("weaver", None, 1024, 32, 32),  # the Weaver's candidate_pool_size
        ("weaver", 16, 1024, 32, 16),  # a smaller explicit pool is allowed
        ("ddtree", None, 1024, None, 512),
        ("chain", None, 40, None, 40),  # min(512, vocabulary)
    ],
)
def test_candidate_pool_comes_from_the_checkpoints(tree, explicit, vocab, weaver_pool,
                                                   expected):
    options = TfmOptions(tree=tree, candidate_pool=explicit, fanout=4)
    assert resolve_candidate_pool(options, vocab, weaver_pool).candidate_pool == expected


@pytest.mark.parametrize(
    "explicit, fanout, vocab, weaver_pool, message",
    [
        (64, 8, 1024, 32, r"candidate_pool'\] = 64 exceeds the Weaver's candidate_pool_size 32"),
        (2000, 8, 1024, None, r"candidate_pool'\] must be <= the vocabulary size 1024, got 2000"),
        (None, 8, 40, 512, r"weaver'\]: candidate_pool_size 512 exceeds the target's "
                          r"vocabulary size 40"),
        (None, 64, 1024, 32, r"fanout'\] must be in \[1, 32\]"),
    ],
)
def test_candidate_pool_against_the_checkpoints_names_the_field(explicit, fanout, vocab,
                                                                weaver_pool, message):
    options = TfmOptions(candidate_pool=explicit, fanout=fanout)
    with pytest.raises(ValueError, match=message):
        resolve_candidate_pool(options, vocab, weaver_pool)
