"""Slow, obviously-correct tree attention and KV commit: the tests' reference.

Visibility is rebuilt by walking parent pointers (``meta.parents`` and
``meta.num_nodes`` only), and the paged cache is read one position at a time.
"""

from __future__ import annotations

import torch

from triton_ops.tree_metadata import TreeMetadata, root_to_node_path


def _cache_row(cache: torch.Tensor, block_table: torch.Tensor, b: int, pos: int) -> torch.Tensor:
    """[Hkv, D] entry of logical position ``pos`` of request ``b``."""
    block_size = cache.shape[1]
    return cache[int(block_table[b, pos // block_size]), pos % block_size]


def naive_tree_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    prefix_lens: torch.Tensor,
    meta: TreeMetadata,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Dense masked softmax attention in float64. Shapes as in ``paged_tree_attention``.

    Returns [B, N, Hq, D] float64, zeros at padded nodes.
    """
    B, N, Hq, D = q.shape
    group = Hq // key_cache.shape[2]
    out = torch.zeros(B, N, Hq, D, dtype=torch.float64)
    for b in range(B):
        prefix = int(prefix_lens[b])
        parents = meta.parents[b].tolist()
        depth = [len(root_to_node_path(parents, j)) - 1 for j in range(N)]
        for i in range(int(meta.num_nodes[b])):
            # (logical cache position, token position) of every key node i sees.
            keys = [(p, p) for p in range(prefix)]
            keys += [(prefix + j, prefix + depth[j]) for j in root_to_node_path(parents, i)]
            if sliding_window is not None:
                query_pos = prefix + depth[i]
                keys = [(p, t) for p, t in keys if query_pos - t < sliding_window]
            k = torch.stack([_cache_row(key_cache, block_table, b, p) for p, _ in keys]).double()
            v = torch.stack([_cache_row(value_cache, block_table, b, p) for p, _ in keys]).double()
            for h in range(Hq):
                logits = k[:, h // group] @ q[b, i, h].double() * scale
                if logits_soft_cap is not None:
                    logits = logits_soft_cap * torch.tanh(logits / logits_soft_cap)
                out[b, i, h] = torch.softmax(logits, 0) @ v[:, h // group]
    return out


def naive_tree_kv_commit(
    key_caches: list[torch.Tensor],
    value_caches: list[torch.Tensor],
    block_table: torch.Tensor,
    prefix_lens: torch.Tensor,
    meta: TreeMetadata,
    accepted_leaf: torch.Tensor,
) -> None:
    """In place, one row at a time: each accepted node's K/V moves from logical
    position ``prefix + node`` to ``prefix + depth(node)``, shallowest first."""
    for cache in list(key_caches) + list(value_caches):
        for b in range(block_table.shape[0]):
            leaf = int(accepted_leaf[b])
            if leaf < 0:
                continue
            prefix = int(prefix_lens[b])
            path = root_to_node_path(meta.parents[b].tolist(), leaf)
            for depth, node in enumerate(path):
                _cache_row(cache, block_table, b, prefix + depth).copy_(
                    _cache_row(cache, block_table, b, prefix + node)
                )
