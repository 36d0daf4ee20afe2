"""Commit of the accepted path's K/V: node ``j`` of the path moves from logical
position ``prefix_len + j`` to ``prefix_len + depth(j)``, for every attention layer.

Path nodes have increasing indices from root to leaf and ``depth(j) <= j``, so
a move never writes a position that a later (deeper) move reads; copying in
index order is the sequential semantics, and so is reading every source before
writing any destination.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton_ops.tree_attention.paged import (
    cache_geometry,
    check_block_table,
    check_paged_cache,
    check_positions_fit,
    check_untiled,
    physical_index,
    read_rows,
    write_rows,
)
from triton_ops.tree_metadata import TreeMetadata, check_accepted_leaf
from triton_ops.utils import (
    bit_is_set,
    check_same_device,
    device_table,
    host_readable,
    use_triton,
)

# Element copies move raw bits, so fp8 caches (often held as uint8) work too.
_BITS_TYPE = {1: tl.int8, 2: tl.int16, 4: tl.int32}
CACHE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn,
                torch.float8_e5m2, torch.uint8)


@triton.jit
def _tree_kv_commit_kernel(
    pointers_ptr, block_table_ptr, prefix_ptr, leaf_ptr, depths_ptr, words_ptr,
    block_size, row_elems, D,
    stride_tb, stride_tk,
    stride_db, stride_dn,
    stride_wb, stride_wn, stride_ww,
    stride_cb, stride_ct, stride_ch, stride_cd,
    ELEM: tl.constexpr, BLOCK: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    cache = tl.load(pointers_ptr + tl.program_id(1)).to(tl.pointer_type(ELEM))
    leaf = tl.load(leaf_ptr + b)
    prefix_len = tl.load(prefix_ptr + b).to(tl.int64)
    offs = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < row_elems
    within_row = (offs // D) * stride_ch + (offs % D) * stride_cd
    table = block_table_ptr + b * stride_tb
    # Node 0 can only sit at depth 0: the first possible move is node 1. Each
    # thread copies the same elements on every iteration, so its own program
    # order keeps a row's read ahead of a later overwrite of that row.
    for j in range(1, leaf + 1):
        word = tl.load(words_ptr + b * stride_wb + leaf * stride_wn + (j // 64) * stride_ww)
        depth = tl.load(depths_ptr + b * stride_db + j * stride_dn)
        if bit_is_set(word, j) & (depth != j):
            src = prefix_len + j
            dst = prefix_len + depth
            src_block = tl.load(table + (src // block_size) * stride_tk).to(tl.int64)
            dst_block = tl.load(table + (dst // block_size) * stride_tk).to(tl.int64)
            row = tl.load(cache + src_block * stride_cb + (src % block_size) * stride_ct + within_row,
                          mask=mask)
            tl.store(cache + dst_block * stride_cb + (dst % block_size) * stride_ct + within_row,
                     row, mask=mask)


def tree_kv_commit(
    key_caches: list[torch.Tensor],
    value_caches: list[torch.Tensor],
    block_table: torch.Tensor,
    prefix_lens: torch.Tensor,
    meta: TreeMetadata,
    accepted_leaf: torch.Tensor,
    backend: str = "auto",
) -> None:
    """Move the accepted nodes' K/V to contiguous positions after the prefix, in place.

    Args:
        key_caches, value_caches: one [num_blocks, block_size, Hkv, D] view per
            attention layer (on the PyTorch path also a tiled view, as in
            ``paged_tree_attention``), all of one geometry and dtype; strides
            and tiles may differ.
        block_table: [B, max_blocks] int32/int64.
        prefix_lens: [B] int32/int64, committed tokens before the tree.
        meta: tree metadata of the step.
        accepted_leaf: [B] int32/int64, last accepted node, -1 = nothing moves.
        backend: ``"auto"`` (one Triton launch for all layers on CUDA, PyTorch
            elsewhere), ``"torch"`` or ``"triton"`` (see :func:`triton_ops.utils.use_triton`).
    """
    key_caches, value_caches = list(key_caches), list(value_caches)
    if not key_caches or len(key_caches) != len(value_caches):
        raise ValueError(
            f"key_caches and value_caches must be non-empty lists of equal length, "
            f"got {len(key_caches)} and {len(value_caches)}"
        )
    caches = key_caches + value_caches
    names = [f"key_caches[{i}]" for i in range(len(key_caches))] + \
        [f"value_caches[{i}]" for i in range(len(value_caches))]
    first = caches[0]
    check_paged_cache(names[0], first, dtypes=CACHE_DTYPES)
    geometry = cache_geometry(first)
    _, block_size, Hkv, D = geometry
    for name, cache in zip(names[1:], caches[1:]):
        check_paged_cache(name, cache, geometry, CACHE_DTYPES)
        if cache.dtype != first.dtype or cache.device != first.device:
            raise ValueError(
                f"{name} must share key_caches[0]'s dtype {first.dtype} and device "
                f"{first.device}, got {cache.dtype} {cache.device}"
            )
    B = meta.batch_size
    device = first.device
    check_block_table(block_table, prefix_lens, B, first, names[0])
    check_same_device(names[0], first, accepted_leaf=accepted_leaf, meta=meta.depths)
    check_accepted_leaf(accepted_leaf, meta)
    if host_readable(prefix_lens):
        check_positions_fit(block_table, prefix_lens, meta.num_nodes, block_size)

    if not use_triton(backend, first):
        node = torch.arange(meta.max_nodes, device=device)
        moves = meta.path_mask(accepted_leaf) & (node != meta.depths)
        b, j = moves.nonzero(as_tuple=True)
        prefix = prefix_lens.long()[b]
        src = physical_index(block_table[b], (prefix + j).view(-1, 1), block_size)
        dst = physical_index(block_table[b], (prefix + meta.depths[b, j].long()).view(-1, 1),
                             block_size)
        for cache in caches:
            write_rows(cache, *dst, read_rows(cache, *src))
        return

    for name, cache in zip(names, caches):
        check_untiled(name, cache)
    row_elems = Hkv * D
    BLOCK = min(1024, triton.next_power_of_2(row_elems))
    words = meta.ancestor_words
    # One launch per stride pattern (e.g. CPU-style caches store keys and
    # values differently); usually one launch for all layers.
    by_strides: dict[tuple, list[torch.Tensor]] = {}
    for cache in caches:
        by_strides.setdefault(cache.stride(), []).append(cache)
    for strides, group in by_strides.items():
        _tree_kv_commit_kernel[(B, len(group), triton.cdiv(row_elems, BLOCK))](
            device_table([[cache.data_ptr()] for cache in group], device), block_table,
            prefix_lens, accepted_leaf, meta.depths, words,
            block_size, row_elems, D,
            *block_table.stride(), *meta.depths.stride(), *words.stride(), *strides,
            ELEM=_BITS_TYPE[first.element_size()], BLOCK=BLOCK,
            num_warps=4,
        )
