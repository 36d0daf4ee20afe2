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
from vllm_tfm.vllm_glue.tree_step import select_requests


# CPU_ATTN ISAs whose block layout we read: per (block, kv head) the block's
# keys are stored transposed, [D, block_size], followed by its values,
# [block_size, D] (established against vLLM's own cpu_attn_reshape_and_cache
# in tests/test_glue_cpu_cache.py). AMX packs keys differently.
CPU_READABLE_ISAS = ("vec", "vec16")


def cpu_key_value_views(kv_cache: torch.Tensor, isa: str) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU_ATTN's [blocks, kv_heads, block_size, 2 * D] cache as two
    [blocks, block_size, kv_heads, D] strided views (keys, values)."""
    if isa not in CPU_READABLE_ISAS:
        raise RuntimeError(
            f"dflash_tfm reads CPU_ATTN KV blocks of ISA {list(CPU_READABLE_ISAS)}; this "
            f"machine's attention ISA is {isa!r}"
        )
    num_blocks, num_kv_heads, block_size, double_head = kv_cache.shape
    head_size = double_head // 2
    block_stride, head_stride, row_stride, _ = kv_cache.stride()
    if kv_cache.stride(3) != 1 or row_stride != double_head:
        raise RuntimeError(f"unexpected CPU KV cache strides {kv_cache.stride()}")
    size = (num_blocks, block_size, num_kv_heads, head_size)
    offset = kv_cache.storage_offset()
    keys = kv_cache.as_strided(size, (block_stride, 1, head_stride, block_size), offset)
    values = kv_cache.as_strided(
        size, (block_stride, head_size, head_stride, 1), offset + block_size * head_size
    )
    return keys, values


def _sliding_window(setting) -> int | None:
    """The window in tokens, or None: CPU_ATTN keeps an int (-1 or None for
    none), TRITON_ATTN a (left, right) pair with left = window - 1 (-1: none)."""
    if isinstance(setting, tuple):
        return setting[0] + 1 if setting[0] >= 0 else None
    return setting if setting not in (-1, None) else None


def tree_attention_rows(step, impl, query, kv_views, block_table, output) -> None:
    """Overwrite ``output`` rows of the step's tree nodes with tree attention."""
    from triton_ops.tree_attention import tree_attention

    requests = step.tree_requests()
    rows = step.token_rows.index_select(0, requests)
    valid = rows >= 0
    num_heads = query.shape[1]
    q = query.new_zeros(rows.shape[0], rows.shape[1], num_heads, query.shape[2])
    q[valid] = query[rows[valid]]
    key_cache, value_cache = kv_views
    window = _sliding_window(impl.sliding_window)
    out = tree_attention(
        q,
        key_cache,
        value_cache,
        block_table.index_select(0, requests).to(torch.int32),
        step.prefix_lens.index_select(0, requests),
        select_requests(step.meta, requests),
        impl.scale,
        sliding_window=window,
        logits_soft_cap=impl.logits_soft_cap or None,  # vLLM writes 0 for "none"
    )
    output[rows[valid]] = out[valid].to(output.dtype)


def wrap_tree_attention_forward(original, key_value_views):
    """An ``AttentionImpl.forward`` whose tree rows are recomputed with tree attention.

    ``key_value_views(impl, layer, kv_cache)`` returns the backend's cache as
    two [blocks, block_size, kv_heads, D] views (keys, values).
    """

    @functools.wraps(original)
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        step = tree_step.active()
        if (
            step is None
            or attn_metadata is None
            or self.attn_type != "decoder"
            or step.tree_requests().numel() == 0
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
