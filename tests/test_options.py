"""The dflash_tfm options: defaults, translation to vLLM's dflash, and every rejection."""

import pytest

from vllm_tfm.options import DEFAULT_BUDGET, MAX_BUDGET, TfmOptions, split_speculative_config

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
        "weaver", "auto", 8, 512)
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
        ({"fanout": 600}, r"fanout'\] must be in \[1, 512\]"),
        ({"expand_width": 33}, r"expand_width'\] must be in \[1, 32\]"),
        ({"candidate_pool": True}, r"candidate_pool'\] must be an integer"),
    ],
)
def test_bad_options_name_the_field(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        split(tmp_path, **overrides)
