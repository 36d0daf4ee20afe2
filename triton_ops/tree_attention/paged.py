"""Logical-position addressing of vLLM's paged KV caches (PyTorch paths), and
the cache checks that attention and KV commit share.

A cache is a plain or a tiled view (shapes in ``paged_tree_attention``'s docstring);
the PyTorch paths read and write whole [Hkv, D] rows of either through
``read_rows`` and ``write_rows``; the Triton kernels take plain views only.
"""

from __future__ import annotations

import torch

from triton_ops.utils import FLOAT_DTYPES, INDEX_DTYPES, check_index_vector, check_same_device

PLAIN_SHAPE = "[num_blocks, block_size, Hkv, D]"
TILED_SHAPE = "[num_blocks, block_size / TL, TL, Hkv, D / DL, DL]"


def cache_geometry(cache: torch.Tensor) -> tuple[int, int, int, int]:
    """(num_blocks, block_size, Hkv, D) of a plain or tiled cache view."""
    if cache.dim() == 6:
        num_blocks, token_tiles, token_tile, Hkv, channel_tiles, channel_tile = cache.shape
        return num_blocks, token_tiles * token_tile, Hkv, channel_tiles * channel_tile
    num_blocks, block_size, Hkv, D = cache.shape
    return num_blocks, block_size, Hkv, D


def read_rows(cache: torch.Tensor, block: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """A copy of the [Hkv, D] rows at (``block``, ``offset``), long tensors of one
    shape S: [*S, Hkv, D]."""
    if cache.dim() == 6:
        token_tile = cache.shape[2]
        return cache[block, offset // token_tile, offset % token_tile].flatten(-2)
    return cache[block, offset]


def write_rows(
    cache: torch.Tensor, block: torch.Tensor, offset: torch.Tensor, rows: torch.Tensor
) -> None:
    """Store ``rows`` [*S, Hkv, D] at (``block``, ``offset``) of shape S, in place."""
    if cache.dim() == 6:
        token_tile = cache.shape[2]
        cache[block, offset // token_tile, offset % token_tile] = rows.unflatten(
            -1, cache.shape[-2:]
        )
    else:
        cache[block, offset] = rows


def physical_index(
    block_table: torch.Tensor, positions: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(block, offset) of logical ``positions`` [B, L] (long) of each request.

    Positions past a request's table are clamped onto its last entry: callers
    mask what those rows read.
    """
    column = (positions // block_size).clamp(0, block_table.shape[1] - 1)
    return torch.gather(block_table.long(), 1, column), positions % block_size


def check_paged_cache(
    name: str,
    cache: torch.Tensor,
    geometry: tuple[int, int, int, int] | None = None,
    dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES,
) -> None:
    """``geometry``: the (num_blocks, block_size, Hkv, D) the cache must have."""
    if cache.dim() not in (4, 6):
        raise ValueError(
            f"{name} must be {PLAIN_SHAPE} or tiled {TILED_SHAPE}, got {list(cache.shape)}"
        )
    if cache.dtype not in dtypes:
        raise ValueError(f"{name} must be one of {dtypes}, got {cache.dtype}")
    if geometry is not None and cache_geometry(cache) != geometry:
        raise ValueError(
            f"{name} must have the key cache's {PLAIN_SHAPE} = {list(geometry)}, "
            f"got {list(cache_geometry(cache))} (shape {list(cache.shape)})"
        )


def check_untiled(name: str, cache: torch.Tensor) -> None:
    """The Triton kernels address a row by one block stride and one offset stride."""
    if cache.dim() != 4:
        raise ValueError(
            f"{name} must be a plain {PLAIN_SHAPE} view for the Triton kernels, got the "
            f"tiled view {list(cache.shape)}: tiled layouts are CPU-only (backend='torch')"
        )


def check_block_table(
    block_table: torch.Tensor, prefix_lens: torch.Tensor, batch: int, like: torch.Tensor, name: str
) -> None:
    """``like`` (named ``name``) is the tensor whose device the two must share."""
    if block_table.dim() != 2 or block_table.shape[0] != batch:
        raise ValueError(f"block_table must be [B={batch}, max_blocks], got {list(block_table.shape)}")
    if block_table.dtype not in INDEX_DTYPES:
        raise ValueError(f"block_table must be int32 or int64, got {block_table.dtype}")
    check_index_vector("prefix_lens", prefix_lens, batch)
    check_same_device(name, like, block_table=block_table, prefix_lens=prefix_lens)


def check_positions_fit(
    block_table: torch.Tensor, prefix_lens: torch.Tensor, num_nodes: torch.Tensor, block_size: int
) -> None:
    """Every request's prefix and tree must fit its block table. Reads values: CPU only."""
    capacity = block_table.shape[1] * block_size
    too_long = (prefix_lens < 0) | (prefix_lens + num_nodes > capacity)
    if bool(too_long.any()):
        b = int(too_long.nonzero()[0, 0])
        raise ValueError(
            f"prefix_lens[{b}] = {int(prefix_lens[b])} must lie in "
            f"[0, {capacity - int(num_nodes[b])}]: the prefix and its {int(num_nodes[b])} nodes "
            f"must fit block_table's {block_table.shape[1]} blocks of {block_size}"
        )
