"""Full-attention layers over a draft tree on CUDA (vLLM's TRITON_ATTN backend).

Same scheme as on CPU (:mod:`.attention`): vLLM writes every node's K/V at its
linear slot before the layer's forward, then the tree rows are recomputed with
``triton_ops.tree_attention`` over strided views of the paged cache.
"""

from __future__ import annotations

import torch

from vllm_tfm.vllm_glue.attention import wrap_tree_attention_forward

# KV cache dtypes whose blocks hold plain model-dtype K/V (no scales, no packing).
PLAIN_KV_CACHE_DTYPES = ("auto", "bfloat16", "float16")


def triton_key_value_views(
    kv_cache: torch.Tensor, head_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """TRITON_ATTN's cache, logically [blocks, kv_heads, block_size, 2 * D] with
    each row's key then value along the last dim (whatever the physical stride
    order), as two [blocks, block_size, kv_heads, D] strided views (keys, values)."""
    if kv_cache.dim() != 4 or kv_cache.shape[-1] != 2 * head_size:
        raise RuntimeError(
            f"dflash_tfm expects a TRITON_ATTN cache [blocks, kv_heads, block_size, "
            f"2 * {head_size}], got {list(kv_cache.shape)}"
        )
    keys, values = kv_cache.transpose(1, 2).split(head_size, dim=-1)
    return keys, values


def _impl_key_value_views(
    impl, layer, kv_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    if impl.kv_cache_dtype not in PLAIN_KV_CACHE_DTYPES:
        raise RuntimeError(
            f"dflash_tfm's tree attention reads unquantized KV caches only "
            f"(kv_cache_dtype in {list(PLAIN_KV_CACHE_DTYPES)}), got {impl.kv_cache_dtype!r}"
        )
    return triton_key_value_views(kv_cache, impl.head_size)


def wrap_triton_attention_forward(original):
    return wrap_tree_attention_forward(original, _impl_key_value_views)
