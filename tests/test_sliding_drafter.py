"""DFlash drafters mixing sliding-window and full attention, on CPU (model runner V1).

vLLM builds them on model runner V2 only; dflash_tfm runs them on V1
(vllm_tfm/vllm_glue/sliding_drafter.py): each layer resolved as vLLM resolves it on V2, every
draft layer in one KV-cache group (the windowed ones allocated as full attention that keeps
the window), each layer's own causality in its attention metadata. The engine test drafts with
the trained family's drafter turned mixed (layer 0 sliding over 24 tokens, layer 1 full) and
requires greedy output equal to no speculation, up to bf16 ties.
"""

from __future__ import annotations

import gc
import os
from types import SimpleNamespace

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from vllm_tfm.tiny.engine_runs import (  # noqa: E402
    PROMPTS,
    compare_greedy,
    cpu_engine,
    engine_greedy,
    mean_accepted_length,
    spec_counters,
    top2_margins,
)
from vllm_tfm.tiny.family import trained_family, with_sliding_window_drafter  # noqa: E402
from vllm_tfm.vllm_glue.sliding_drafter import (  # noqa: E402
    mixes_sliding_and_full,
    single_type_view,
)

WINDOW = 24
PROMPT_COUNT = 4
MAX_TOKENS = 24


def _drafter_config(layer_types, **dflash_config):
    from transformers import Qwen3Config

    config = Qwen3Config(num_hidden_layers=len(layer_types), layer_types=layer_types)
    config.dflash_config = {"swa_window_size": WINDOW, **dflash_config}
    return config


@pytest.mark.parametrize("layer_types", [
    ["sliding_attention", "full_attention"],
    ["full_attention", "sliding_attention", "full_attention"],
    ["sliding_attention", "sliding_attention", "full_attention", "full_attention"],
])
@pytest.mark.parametrize("dflash_config", [{}, {"use_swa": True}, {"causal": True},
                                           {"causal": False}])
def test_each_layer_resolves_as_on_model_runner_v2(layer_types, dflash_config, monkeypatch):
    """Window and causality of every layer from the single-type view equal what vLLM's
    resolution gives that layer when model runner V2 builds the whole mixed drafter."""
    from vllm.model_executor.models import qwen3_dflash

    resolve = getattr(qwen3_dflash._resolve_layer_attention, "__vllm_tfm_original__",
                      qwen3_dflash._resolve_layer_attention)
    config = _drafter_config(layer_types, **dflash_config)
    assert mixes_sliding_and_full(config)
    monkeypatch.setattr(qwen3_dflash, "get_current_vllm_config",
                        lambda: SimpleNamespace(use_v2_model_runner=True))
    on_v2 = [resolve(config, layer) for layer in range(len(layer_types))]
    monkeypatch.setattr(qwen3_dflash, "get_current_vllm_config",
                        lambda: SimpleNamespace(use_v2_model_runner=False))
    with pytest.raises(NotImplementedError, match="V2 model runner"):
        resolve(config, 0)
    viewed = [resolve(single_type_view(config, layer), layer)
              for layer in range(len(layer_types))]
    assert viewed == on_v2
    assert {window for window, _ in viewed} == {WINDOW, None}  # the mix survives
    assert config.layer_types == layer_types  # the drafter's own config is untouched


def test_vllm_dflash_keeps_refusing_a_mixed_drafter_on_v1(tmp_path):
    """The plugin lets the mix through for dflash_tfm only: vLLM's own dflash is refused as
    before, at config validation."""
    family = with_sliding_window_drafter(trained_family(), WINDOW, tmp_path)
    with pytest.raises(ValueError, match="mixed sliding/full dflash drafts"):
        cpu_engine(family.target, {"method": "dflash", "model": str(family.dflash),
                                   "num_speculative_tokens": 15})


@pytest.mark.engine
def test_mixed_drafter_drafts_losslessly_in_one_kv_group(tmp_path, monkeypatch):
    from vllm import SamplingParams
    from vllm.v1.attention.backends import cpu_attn
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    family = with_sliding_window_drafter(trained_family(), WINDOW, tmp_path)
    prompts = PROMPTS[:PROMPT_COUNT]
    baseline = engine_greedy(family.target, None, prompts, max_tokens=MAX_TOKENS)
    llm = cpu_engine(family.target, {
        "method": "dflash_tfm", "model": str(family.dflash), "num_speculative_tokens": 16,
        "weaver": str(family.weaver)}, max_num_seqs=PROMPT_COUNT, disable_log_stats=False)
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    drafter = runner.drafter
    sliding, full = drafter.model.get_draft_kv_cache_layer_names()
    assert drafter.model.get_draft_attn_causal() == [True, False]
    groups = [group for group in runner.kv_cache_config.kv_cache_groups
              if {sliding, full} & set(group.layer_names)]
    assert len(groups) == 1 and {sliding, full} <= set(groups[0].layer_names)
    assert isinstance(groups[0].kv_cache_spec, FullAttentionSpec)
    context = runner.compilation_config.static_forward_context
    assert context[sliding].impl.sliding_window == WINDOW
    assert context[full].impl.sliding_window in (-1, None)

    seen = set()
    forward = cpu_attn.CPUAttentionBackendImpl.forward

    def recording_forward(self, layer, query, key, value, kv_cache, attn_metadata, *args,
                          **kwargs):
        if attn_metadata is not None and layer.layer_name in (sliding, full):
            seen.add((layer.layer_name, bool(attn_metadata.causal)))
        return forward(self, layer, query, key, value, kv_cache, attn_metadata, *args,
                       **kwargs)

    monkeypatch.setattr(cpu_attn.CPUAttentionBackendImpl, "forward", recording_forward)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    outputs = llm.generate(list(prompts), params, use_tqdm=False)
    drafts, accepted = spec_counters(llm)
    del llm, runner, drafter, context
    gc.collect()

    assert seen == {(sliding, True), (full, False)}
    result = {"tokens": [list(o.outputs[0].token_ids) for o in outputs],
              "margins": [top2_margins(o.outputs[0].logprobs) for o in outputs]}
    rows = compare_greedy(baseline, result)
    for prompt, row in enumerate(rows):
        assert row["matched"] == row["length"] or row["tie"], (
            f"prompt {prompt}: greedy output differs at token {row['matched']} where the "
            f"baseline's top-2 margin is {row.get('margin')} (not a bf16 tie)")
    assert sum(row["matched"] for row in rows) >= PROMPT_COUNT * MAX_TOKENS // 2
    # The mixed drafter still drafts what the target accepts (measured 2.45 on 4 x 24).
    assert mean_accepted_length(drafts, accepted) > 1.5
