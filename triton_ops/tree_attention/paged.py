"""Logical-position addressing of vLLM's paged KV caches (PyTorch paths)."""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


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
    reference_shape: tuple[int, ...] | None = None,
    dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES,
) -> None:
    if cache.dim() != 4:
        raise ValueError(f"{name} must be [num_blocks, block_size, Hkv, D], got {list(cache.shape)}")
    if cache.dtype not in dtypes:
        raise ValueError(f"{name} must be one of {dtypes}, got {cache.dtype}")
    if reference_shape is not None and tuple(cache.shape) != reference_shape:
        raise ValueError(
            f"{name} must have the key cache's shape {list(reference_shape)}, "
            f"got {list(cache.shape)}"
        )


def check_block_table(
    block_table: torch.Tensor, prefix_lens: torch.Tensor, batch: int, device: torch.device
) -> None:
    if block_table.dim() != 2 or block_table.shape[0] != batch:
        raise ValueError(f"block_table must be [B={batch}, max_blocks], got {list(block_table.shape)}")
    if block_table.dtype not in INDEX_DTYPES:
        raise ValueError(f"block_table must be int32 or int64, got {block_table.dtype}")
    if prefix_lens.shape != (batch,) or prefix_lens.dtype not in INDEX_DTYPES:
        raise ValueError(
            f"prefix_lens must be int32/int64 of shape [{batch}], "
            f"got {prefix_lens.dtype} {list(prefix_lens.shape)}"
        )
    for name, tensor in (("block_table", block_table), ("prefix_lens", prefix_lens)):
        if tensor.device != device:
            raise ValueError(f"{name} must be on {device}, got {tensor.device}")


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
