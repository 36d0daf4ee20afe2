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


def cpu_key_value_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU_ATTN's [blocks, kv_heads, block_size, 2 * D] cache as two
    [blocks, block_size, kv_heads, D] views (keys, then values, per block)."""
    num_blocks, num_kv_heads, block_size, _ = kv_cache.shape
    paired = kv_cache.view(num_blocks, num_kv_heads, 2 * block_size, -1)
    keys, values = paired.chunk(2, dim=2)
    return keys.permute(0, 2, 1, 3), values.permute(0, 2, 1, 3)


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
    window = impl.sliding_window if impl.sliding_window not in (-1, None) else None
    out = tree_attention(
        q,
        key_cache,
        value_cache,
        block_table.index_select(0, requests).to(torch.int32),
        step.prefix_lens.index_select(0, requests),
        select_requests(step.meta, requests),
        impl.scale,
        sliding_window=window,
        logits_soft_cap=impl.logits_soft_cap,
    )
    output[rows[valid]] = out[valid].to(output.dtype)


def wrap_cpu_attention_forward(original):
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
            step, self, query[:num_tokens], cpu_key_value_views(kv_cache),
            attn_metadata.block_table, out_rows,
        )
        return output

    return forward
