"""Tree attention over a paged KV cache: every draft-tree node attends to the
committed prefix and to its own ancestors (itself included), never to siblings.

The tree nodes' K/V already sit in the paged cache at logical positions
``prefix_len + node`` (the engine writes them with the linear slot mapping);
node ``i`` is a query at token position ``prefix_len + depth(i)``.

CUDA runs two kernels (flash-decoding):

- ``_tree_attention_split_kernel``: the prefix, cut into ``num_splits`` chunks.
  A program takes one chunk and a block of query rows of one KV head. Rows are
  node-major over the G query heads of the GQA group (row ``r``: node ``r // G``,
  head ``h G + r % G``), so each K/V tile is read once per row block and feeds a
  [BLOCK_M, D] x [D, BLOCK_N] product on the tensor cores. Every node sees the
  whole prefix, so the steady-state loop has no mask at all (the sliding window
  aside); the softmax rescales the accumulator only when some row's maximum
  grew past a slack (exact either way: the stale maximum is what both the
  partial sums and the log-sum-exp use).
- ``_tree_attention_merge_kernel``: per small block of rows and block of value
  columns, attention to the tree keys (at most N) under the ancestor mask, folded
  together with the prefix partials into the output. The logits take the whole
  head dimension, so each column block recomputes them (N keys: cheap).

The split count depends on shapes only and chunks past a short prefix stay
idle, so nothing waits on the host and the launch is graph-safe.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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
)
from triton_ops.tree_metadata import TreeMetadata, check_node_tensor
from triton_ops.utils import (
    FLOAT_DTYPES,
    bit_is_set,
    check_same_device,
    dot_block,
    host_readable,
    output_buffer,
    use_triton,
)

LOG2E = math.log2(math.e)
MAX_HEAD_DIM = 256
MAX_SPLITS = 64
# A split count within this factor of the best modelled time is good enough; the
# smallest such count wins, since every split adds a partial to write and merge.
SPLIT_TOLERANCE = 1.05
# Rescale the accumulator only when a row's maximum grew by more than this many
# log2 units: the probabilities then stay below 2^8 (exact in fp32 and in the
# 16-bit P operand's exponent), and the [BLOCK_M, D] multiply is skipped in almost
# every tile of a long prefix.
RESCALE_SLACK = 8.0
MERGE_ROWS = 16
# Value columns of one merge program: at D = 256 four programs share a row block, so a
# 65-node tree of 24 / 4 heads runs 400 merge programs, not 100 (0.38 of a wave at 6 %
# occupancy under ncu, stop 39). The op gains 0.5-3 % (H100; BENCHMARKS.md, "Stop 40");
# 32 columns recompute the tree logits too often and lose.
MERGE_COLUMNS = 64
# Prefix partials the merge kernel loads at once: its split loop unrolls this many and
# runs ceil(num_splits / it) times, so one compiled merge kernel serves every split count
# (a kernel per count compiled 2-12 s each as batches of new shapes came: BENCHMARKS.md,
# "Stop 35").
MERGE_SPLITS_IN_FLIGHT = 16
# Split-kernel parameters on CUDA by row-tile height: (block_m, block_n, num_warps,
# num_stages, programs_per_sm, rescale_slack). 128 rows: two warpgroups of 64, Q and
# two K/V stages of 64 keys fill 192 KB of shared memory, one program per SM.
# 64 rows: one warpgroup, 96 KB, two programs per SM (each K/V tile is then read by
# twice as many programs: more L2 traffic). tools/bench_kernels.py --sweep times
# the alternatives and overrides these for its tables.
CUDA_TILES = {128: (128, 64, 8, 2, 1, RESCALE_SLACK), 64: (64, 32, 4, 2, 2, RESCALE_SLACK)}
# Time of one row tile of each height relative to a 64-row tile's, over the same keys: a
# 128-row tile feeds each K/V tile to twice the rows (H100, B = 1, prefix 32k: 55.4 against
# 35.6 us per tile at 64 and 128 nodes; BENCHMARKS.md, "Stop 40", the split sweep).
TILE_COST = {128: 1.5, 64: 1.0}


@dataclass(frozen=True)
class KernelConfig:
    """Launch parameters of the split kernel.

    ``min_chunk`` (a multiple of ``block_n``) is the fewest prefix keys a split
    takes, so short prefixes leave splits idle rather than run many tiny ones.
    ``programs_per_sm``: how many split programs one SM holds at a time (registers
    and shared memory), which the split count fills whole waves of.
    ``rescale_slack``: :data:`RESCALE_SLACK`; 0 rescales whenever a maximum grows,
    a negative value every tile without the branch (the textbook online softmax).
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    min_chunk: int
    num_splits: int
    programs_per_sm: int = 1
    rescale_slack: float = RESCALE_SLACK


@triton.jit
def _raise_maximum(m_i, l_i, acc, m_tile, MASKED: tl.constexpr):
    """Move the running maxima up to ``m_tile`` where it is larger, rescaling the sums."""
    m_new = tl.maximum(m_i, m_tile)
    if MASKED:
        # A row that has seen no visible key keeps m = -inf (and acc = l = 0).
        alpha = tl.exp2(m_i - tl.where(m_new == float("-inf"), 0.0, m_new))
    else:
        alpha = tl.exp2(m_i - m_new)
    return m_new, l_i * alpha, acc * alpha[:, None]


@triton.jit
def _tile_logits(
    q, k_ptr, k_rows, key_ok, visible, offs_d, stride_kd, qk_scale, soft_cap,
    MASKED: tl.constexpr, EVEN_D: tl.constexpr, HEAD_DIM: tl.constexpr, SOFT_CAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """[BLOCK_M, BLOCK_N] logits of one key tile in log2 units, -inf where not visible;
    unmasked tiles without a soft cap return the raw scores q.k, which
    :func:`_tile_accumulate` scales inside the exponent's FMA.

    Without a soft cap ``qk_scale`` is scale * log2(e); with one it is
    scale * 2 log2(e) / cap and ``soft_cap`` is cap * log2(e), so that
    cap * tanh(x / cap) * log2(e) = soft_cap * (1 - 2 / (exp2(q.k * qk_scale) + 1)).
    Unmasked tiles (``MASKED`` false) read every key unconditionally.
    """
    k_ptrs = k_ptr + k_rows[:, None] + offs_d[None, :] * stride_kd
    if MASKED:
        if EVEN_D:
            k = tl.load(k_ptrs, mask=key_ok[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs, mask=key_ok[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
    elif EVEN_D:
        k = tl.load(k_ptrs)
    else:
        k = tl.load(k_ptrs, mask=(offs_d < HEAD_DIM)[None, :], other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if SOFT_CAP:
        s = soft_cap - 2.0 * soft_cap / (tl.exp2(s * qk_scale) + 1.0)
    elif MASKED:
        s = s * qk_scale
    if MASKED:
        s = tl.where(visible, s, float("-inf"))
    return s


@triton.jit
def _tile_accumulate(
    logits, m_i, l_i, acc, v_ptr, v_rows, key_ok, offs_d, stride_vd, qk_scale,
    MASKED: tl.constexpr, EVEN_D: tl.constexpr, HEAD_DIM: tl.constexpr, SOFT_CAP: tl.constexpr,
    RESCALE_SLACK: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One online-softmax step: fold a tile's logits and values into (m, l, acc).

    ``m_i`` may lag the true row maximum by up to ``RESCALE_SLACK``: the sums use
    it consistently, so the result is exact. In unmasked tiles every row sees
    every key, so ``m_i`` is finite after the first tile and needs no -inf guards.
    """
    if MASKED:
        m_tile = tl.max(logits, 1)
    elif SOFT_CAP:
        m_tile = tl.max(logits, 1)
    else:
        m_tile = tl.max(logits, 1) * qk_scale  # raw scores; qk_scale > 0
    if RESCALE_SLACK < 0:
        m_i, l_i, acc = _raise_maximum(m_i, l_i, acc, m_tile, MASKED)
    else:
        # One scalar decides for the whole block, so the skipped multiply is a
        # branch (rows not past the slack keep a stale maximum, which is exact).
        if tl.max((m_tile > m_i + RESCALE_SLACK).to(tl.int32), 0) > 0:
            m_i, l_i, acc = _raise_maximum(m_i, l_i, acc, m_tile, MASKED)
    v_ptrs = v_ptr + v_rows[:, None] + offs_d[None, :] * stride_vd
    if MASKED:
        p = tl.exp2(logits - tl.where(m_i == float("-inf"), 0.0, m_i)[:, None])
        if EVEN_D:
            v = tl.load(v_ptrs, mask=key_ok[:, None], other=0.0)
        else:
            v = tl.load(v_ptrs, mask=key_ok[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
    else:
        if SOFT_CAP:
            p = tl.exp2(logits - m_i[:, None])
        else:
            p = tl.exp2(logits * qk_scale - m_i[:, None])
        if EVEN_D:
            v = tl.load(v_ptrs)
        else:
            v = tl.load(v_ptrs, mask=(offs_d < HEAD_DIM)[None, :], other=0.0)
    l_i = l_i + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return m_i, l_i, acc


@triton.jit
def _tile_pages(table, pos, key_ok, block_size, stride_tk, MASKED: tl.constexpr):
    """Cache blocks (int64) of logical positions ``pos`` through a request's block table."""
    if MASKED:
        blk = tl.load(table + (pos // block_size) * stride_tk, mask=key_ok, other=0)
    else:
        blk = tl.load(table + (pos // block_size) * stride_tk)
    return blk.to(tl.int64)


@triton.jit
def _tree_attention_split_kernel(
    q_ptr, k_ptr, v_ptr, block_table_ptr, prefix_ptr, num_nodes_ptr, depths_ptr,
    part_o_ptr, part_lse_ptr,
    Hkv, G, block_size, num_splits, qk_scale, soft_cap, window,
    stride_qb, stride_qn, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_tb, stride_tk,
    stride_db, stride_dn,
    stride_og, stride_os, stride_or,
    stride_lg, stride_ls,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, MIN_CHUNK: tl.constexpr, SOFT_CAP: tl.constexpr, SLIDING: tl.constexpr,
    RESCALE_SLACK: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Partial attention of one row block of one KV head to one prefix chunk.

    Writes, per row, the chunk's normalised output and its log-sum-exp (log2
    units; -inf for an idle chunk or a row that sees none of it) into
    ``part_o[b Hkv + h, split, row]`` and ``part_lse[b Hkv + h, split, row]``.
    """
    pid_m = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2) // Hkv
    h = tl.program_id(2) % Hkv
    num_rows = tl.load(num_nodes_ptr + b) * G
    if pid_m * BLOCK_M >= num_rows:
        return  # only padded nodes: the merge reads none of their partials
    prefix_len = tl.load(prefix_ptr + b).to(tl.int32)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < num_rows
    node = rows // G
    head = h * G + rows % G
    b64 = b.to(tl.int64)
    group = tl.program_id(2).to(tl.int64)
    lse_ptrs = part_lse_ptr + group * stride_lg + split * stride_ls + rows

    low = prefix_len * 0
    if SLIDING:
        # The shallowest query (depth 0) sees keys from prefix_len - window + 1 on.
        low = tl.maximum(prefix_len - window + 1, 0)
    # Chunks are whole tiles, so only the request's last tile is partial.
    chunk = tl.maximum(tl.cdiv(tl.cdiv(prefix_len - low, num_splits), BLOCK_N) * BLOCK_N, MIN_CHUNK)
    start = low + split * chunk
    end = tl.minimum(start + chunk, prefix_len)
    if start >= end:
        tl.store(lse_ptrs, tl.full((BLOCK_M,), float("-inf"), tl.float32), mask=row_ok)
        return

    offs_d = tl.arange(0, BLOCK_D)
    q_ptrs = (q_ptr + b64 * stride_qb + node[:, None] * stride_qn + head[:, None] * stride_qh
              + offs_d[None, :] * stride_qd)
    q = tl.load(q_ptrs, mask=row_ok[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
    q_pos = prefix_len + tl.load(depths_ptr + b * stride_db + node * stride_dn, mask=row_ok, other=0)
    table = block_table_ptr + b64 * stride_tb
    k_head = k_ptr + h * stride_kh
    v_head = v_ptr + h * stride_vh
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)

    if SLIDING:
        full_end = start
    else:
        full_end = start + (end - start) // BLOCK_N * BLOCK_N
    offs_n = tl.arange(0, BLOCK_N)
    blk = _tile_pages(table, start + offs_n, start + offs_n < end, block_size, stride_tk, True)
    for key_start in range(start, full_end, BLOCK_N):
        pos = key_start + offs_n
        # The next tile's pages are read a whole tile ahead, so the K/V copies that
        # the pipeliner issues for it at the end of this tile need not wait on them.
        blk_next = _tile_pages(table, pos + BLOCK_N, pos + BLOCK_N < end, block_size, stride_tk, True)
        offset = pos % block_size
        logits = _tile_logits(
            q, k_head, blk * stride_kb + offset * stride_kt, pos < end, pos < end, offs_d, stride_kd,
            qk_scale, soft_cap, False, EVEN_D, HEAD_DIM, SOFT_CAP, DOT_PRECISION)
        m_i, l_i, acc = _tile_accumulate(
            logits, m_i, l_i, acc, v_head, blk * stride_vb + offset * stride_vt, pos < end, offs_d,
            stride_vd, qk_scale, False, EVEN_D, HEAD_DIM, SOFT_CAP, RESCALE_SLACK, DOT_PRECISION)
        blk = blk_next
    # The partial last tile; with a sliding window every tile, since the window's
    # first keys are visible to shallow nodes only.
    for key_start in range(full_end, end, BLOCK_N):
        pos = key_start + offs_n
        key_ok = pos < end
        visible = key_ok[None, :]
        if SLIDING:
            visible = visible & ((q_pos[:, None] - pos[None, :]) < window)
        blk = _tile_pages(table, pos, key_ok, block_size, stride_tk, True)
        offset = pos % block_size
        logits = _tile_logits(
            q, k_head, blk * stride_kb + offset * stride_kt, key_ok, visible, offs_d, stride_kd,
            qk_scale, soft_cap, True, EVEN_D, HEAD_DIM, SOFT_CAP, DOT_PRECISION)
        m_i, l_i, acc = _tile_accumulate(
            logits, m_i, l_i, acc, v_head, blk * stride_vb + offset * stride_vt, key_ok, offs_d,
            stride_vd, qk_scale, True, EVEN_D, HEAD_DIM, SOFT_CAP, RESCALE_SLACK, DOT_PRECISION)

    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
    part = part_o_ptr + group * stride_og + split * stride_os + rows[:, None] * stride_or + offs_d[None, :]
    tl.store(part, out, mask=row_ok[:, None] & (offs_d < HEAD_DIM)[None, :])
    tl.store(lse_ptrs, lse, mask=row_ok)


@triton.jit(do_not_specialize=["num_splits"])
def _tree_attention_merge_kernel(
    q_ptr, k_ptr, v_ptr, block_table_ptr, prefix_ptr, num_nodes_ptr, depths_ptr, words_ptr,
    part_o_ptr, part_lse_ptr, o_ptr,
    Hkv, G, num_rows_max, block_size, num_splits, qk_scale, soft_cap, window,
    stride_qb, stride_qn, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_tb, stride_tk,
    stride_db, stride_dn,
    stride_wb, stride_wn, stride_ww,
    stride_og, stride_os, stride_or,
    stride_lg, stride_ls,
    stride_yb, stride_yn, stride_yh, stride_yd,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_T: tl.constexpr, SPLITS_IN_FLIGHT: tl.constexpr, SOFT_CAP: tl.constexpr,
    SLIDING: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Attention of BLOCK_R rows of one KV head to their tree ancestors, merged
    with the prefix partials into BLOCK_C columns of ``o``; rows of padded nodes
    get zeros.

    The split loop is unrolled ``SPLITS_IN_FLIGHT`` at a time so that those partials'
    loads are in flight together rather than one latency each."""
    pid_r = tl.program_id(0)
    b = tl.program_id(2) // Hkv
    h = tl.program_id(2) % Hkv
    b64 = b.to(tl.int64)
    group = tl.program_id(2).to(tl.int64)
    num_rows = tl.load(num_nodes_ptr + b) * G
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < num_rows
    node = rows // G
    head = h * G + rows % G
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = offs_c < HEAD_DIM
    out_ptrs = (o_ptr + b64 * stride_yb + node[:, None] * stride_yn + head[:, None] * stride_yh
                + offs_c[None, :] * stride_yd)
    in_tile = (rows < num_rows_max)[:, None] & c_mask[None, :]
    if pid_r * BLOCK_R >= num_rows:
        tl.store(out_ptrs, tl.zeros((BLOCK_R, BLOCK_C), o_ptr.dtype.element_ty), mask=in_tile)
        return

    prefix_len = tl.load(prefix_ptr + b).to(tl.int32)
    q = tl.load(
        q_ptr + b64 * stride_qb + node[:, None] * stride_qn + head[:, None] * stride_qh
        + offs_d[None, :] * stride_qd,
        mask=row_ok[:, None] & d_mask[None, :], other=0.0,
    )
    q_depth = tl.load(depths_ptr + b * stride_db + node * stride_dn, mask=row_ok, other=0)
    table = block_table_ptr + b64 * stride_tb
    m_i = tl.full((BLOCK_R,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_R,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)
    # Ancestors precede their descendants, so the block's last node bounds its keys.
    end = (tl.minimum(pid_r * BLOCK_R + BLOCK_R, num_rows) - 1) // G + 1
    for key_start in range(0, end, BLOCK_T):
        j = key_start + tl.arange(0, BLOCK_T)
        key_ok = j < end
        pos = prefix_len + j
        blk = tl.load(table + (pos // block_size) * stride_tk, mask=key_ok, other=0).to(tl.int64)
        words = tl.load(
            words_ptr + b64 * stride_wb + node[:, None] * stride_wn + (j // 64)[None, :] * stride_ww,
            mask=row_ok[:, None] & key_ok[None, :], other=0,
        )
        visible = bit_is_set(words, j[None, :]) & key_ok[None, :]
        if SLIDING:
            k_depth = tl.load(depths_ptr + b * stride_db + j * stride_dn, mask=key_ok, other=0)
            visible = visible & ((q_depth[:, None] - k_depth[None, :]) < window)
        offset = pos % block_size
        k = tl.load(k_ptr + (blk * stride_kb + offset * stride_kt + h * stride_kh)[:, None]
                    + offs_d[None, :] * stride_kd, mask=key_ok[:, None] & d_mask[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if SOFT_CAP:
            logits = soft_cap - 2.0 * soft_cap / (tl.exp2(s * qk_scale) + 1.0)
        else:
            logits = s * qk_scale
        logits = tl.where(visible, logits, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(logits, 1))
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(logits - m_shift[:, None])
        alpha = tl.exp2(m_i - m_shift)
        v = tl.load(v_ptr + (blk * stride_vb + offset * stride_vt + h * stride_vh)[:, None]
                    + offs_c[None, :] * stride_vd, mask=key_ok[:, None] & c_mask[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new

    # Fold in the prefix partials: weights 2^(lse - m) against the running maximum.
    # A real node sees itself, so m_i is finite here for every row_ok row.
    m_i = tl.where(row_ok, m_i, 0.0)
    for first in range(0, num_splits, SPLITS_IN_FLIGHT):
        for i in tl.static_range(SPLITS_IN_FLIGHT):
            split = first + i
            live = row_ok & (rows * 0 + split < num_splits)  # a tensor mask, as the interpreter needs
            lse = tl.load(part_lse_ptr + group * stride_lg + split * stride_ls + rows,
                          mask=live, other=float("-inf"))
            part = tl.load(
                part_o_ptr + group * stride_og + split * stride_os + rows[:, None] * stride_or
                + offs_c[None, :],
                mask=(lse > float("-inf"))[:, None] & c_mask[None, :], other=0.0,
            )
            m_new = tl.maximum(m_i, lse)
            alpha = tl.exp2(m_i - m_new)
            weight = tl.exp2(lse - m_new)
            acc = acc * alpha[:, None] + part * weight[:, None]
            l_i = l_i * alpha + weight
            m_i = m_new
    out = acc / tl.where(row_ok, l_i, 1.0)[:, None]
    out = tl.where(row_ok[:, None], out, 0.0)
    tl.store(out_ptrs, out.to(o_ptr.dtype.element_ty), mask=in_tile)


def kernel_config(q: torch.Tensor, num_kv_heads: int) -> KernelConfig:
    """Launch parameters of the split kernel for ``q``'s shape and device.

    CUDA: rows come in tiles of the height :func:`tile_height` picks
    (:data:`CUDA_TILES`); key tiles keep the bytes of 16-bit D = 256 tiles; the
    split count then fills whole waves of the SMs.
    """
    B, N, Hq, D = q.shape
    rows = N * (Hq // num_kv_heads)
    if q.device.type != "cuda":
        # The interpreter: small tiles keep it fast, and three splits exercise the merge.
        block_m = min(32, dot_block(rows))
        return KernelConfig(block_m, 16, 4, 1, 16, 3)
    height = tile_height(rows, q.element_size())
    block_m, block_n, num_warps, num_stages, per_sm, slack = CUDA_TILES[height]
    # The tiles are sized for 16-bit D = 256: keep the bytes of a K/V tile (fp32
    # multiplies on the FMA units, whose operands take registers: at most 32 keys).
    widest = 128 if q.element_size() == 2 else 32
    block_n = max(16, min(widest, block_n * 512 // (dot_block(D) * q.element_size())))
    programs_per_split = B * num_kv_heads * triton.cdiv(rows, block_m)
    num_sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    num_splits = split_count(programs_per_split, num_sms * per_sm)
    return KernelConfig(block_m, block_n, num_warps, num_stages, 2 * block_n, num_splits, per_sm,
                        slack)


def tile_height(rows: int, element_size: int) -> int:
    """Row-tile height for ``rows`` query rows a KV head: the one whose tiles cost least
    (:data:`TILE_COST`), 128 on a tie. The engine's 65-node tree of 6-head groups (390
    rows) takes four 128-row tiles (cost 6) rather than seven of 64 (cost 7), though they
    pad more rows. fp32 inputs take 64: a 128-row fp32 Q tile alone is 128 KB at D = 256."""
    if element_size > 2:
        return 64
    return min((128, 64), key=lambda height: triton.cdiv(rows, height) * TILE_COST[height])


def split_count(programs_per_split: int, slots: int, max_splits: int = MAX_SPLITS) -> int:
    """Prefix splits that finish a long prefix soonest: with ``slots`` programs
    running at a time, S splits of a prefix of L keys take ``ceil(P S / slots)``
    waves of ``L / S`` keys each. The smallest S within :data:`SPLIT_TOLERANCE` of
    the least cost wins (fewer partials to write and merge); short prefixes leave
    splits idle."""
    def cost(splits: int) -> float:
        return math.ceil(programs_per_split * splits / slots) / splits

    best = min(cost(splits) for splits in range(1, max_splits + 1))
    return next(s for s in range(1, max_splits + 1) if cost(s) <= SPLIT_TOLERANCE * best)


def _check_inputs(q, key_cache, value_cache, block_table, prefix_lens, meta, scale,
                  sliding_window, logits_soft_cap) -> None:
    check_node_tensor(meta, "q", q, ("Hq", "D"))
    if q.dtype not in FLOAT_DTYPES:
        raise ValueError(f"q must be one of {FLOAT_DTYPES}, got {q.dtype}")
    B, N, Hq, D = q.shape
    check_paged_cache("key_cache", key_cache)
    geometry = cache_geometry(key_cache)
    _, block_size, Hkv, key_dim = geometry
    if key_dim != D or Hq % Hkv != 0:
        raise ValueError(
            f"key_cache must be [num_blocks, block_size, Hkv, D={D}] with Hq={Hq} a multiple "
            f"of Hkv, got {list(geometry)}"
        )
    check_paged_cache("value_cache", value_cache, geometry)
    if not 16 <= D <= MAX_HEAD_DIM:
        raise ValueError(f"q's head dim must lie in [16, {MAX_HEAD_DIM}], got {D}")
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if cache.dtype != q.dtype:
            raise ValueError(f"{name} must have q's dtype {q.dtype}, got {cache.dtype}")
    check_same_device(
        "q", q, key_cache=key_cache, value_cache=value_cache, meta=meta.ancestor_words
    )
    check_block_table(block_table, prefix_lens, B, q, "q")
    if not isinstance(scale, (int, float)) or not scale > 0:
        raise ValueError(f"scale must be a positive float, got {scale!r}")
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"sliding_window must be None or an int >= 1, got {sliding_window!r}")
    if logits_soft_cap is not None and (
        not isinstance(logits_soft_cap, (int, float)) or not logits_soft_cap > 0
    ):
        raise ValueError(f"logits_soft_cap must be None or a positive float, got {logits_soft_cap!r}")
    if host_readable(prefix_lens):
        check_positions_fit(block_table, prefix_lens, meta.num_nodes, block_size)


def _tree_attention_torch(q, key_cache, value_cache, block_table, prefix_lens, meta, scale,
                          sliding_window, logits_soft_cap) -> torch.Tensor:
    """Vectorised over the batch with keys padded to the longest request. [B, N, Hq, D] fp32."""
    B, N, Hq, D = q.shape
    _, block_size, Hkv, _ = cache_geometry(key_cache)
    prefix = prefix_lens.long().view(B, 1)
    positions = torch.arange(int(prefix.max()) + N, device=q.device).expand(B, -1)
    block, offset = physical_index(block_table, positions, block_size)

    tree_index = positions - prefix  # [B, L]: node index of tree keys, < 0 in the prefix
    in_tree = (tree_index >= 0) & (tree_index < N)
    # Table entries past a request's tokens may hold anything, even invalid ids.
    block = torch.where(tree_index < meta.num_nodes.view(B, 1), block, 0)
    node_index = tree_index.clamp(0, N - 1)
    ancestor = torch.gather(meta.ancestors, 2, node_index.unsqueeze(1).expand(B, N, -1))
    visible = (tree_index < 0).unsqueeze(1) | (ancestor & in_tree.unsqueeze(1))
    if sliding_window is not None:
        key_depth = torch.gather(meta.depths.long(), 1, node_index)
        key_pos = torch.where(in_tree, prefix + key_depth, positions)
        query_pos = prefix + meta.depths.long()
        visible &= (query_pos.unsqueeze(2) - key_pos.unsqueeze(1)) < sliding_window
    visible &= meta.valid.unsqueeze(2)
    # Rows no valid query sees may hold anything (NaN included): 0 * NaN would leak.
    used = visible.any(1).view(B, -1, 1, 1)
    keys = torch.where(used, read_rows(key_cache, block, offset).float(), 0.0)
    values = torch.where(used, read_rows(value_cache, block, offset).float(), 0.0)

    queries = q.float().view(B, N, Hkv, Hq // Hkv, D)
    logits = torch.einsum("bnhgd,blhd->bhgnl", queries, keys) * scale
    if logits_soft_cap is not None:
        logits = logits_soft_cap * torch.tanh(logits / logits_soft_cap)
    logits = logits.masked_fill(~visible.view(B, 1, 1, N, -1), float("-inf"))
    probs = torch.softmax(logits, -1).nan_to_num(0.0)  # padded rows see nothing
    out = torch.einsum("bhgnl,blhd->bnhgd", probs, values)
    return out.reshape(B, N, Hq, D)


def paged_tree_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    prefix_lens: torch.Tensor,
    meta: TreeMetadata,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    backend: str = "auto",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of draft-tree nodes to the committed prefix and their ancestors.

    Args:
        q: [B, N, Hq, D] queries of the tree nodes (bf16/fp16; fp32 off CUDA).
        key_cache, value_cache: [num_blocks, block_size, Hkv, D], q's dtype, any
            strides (views into the engine's paged caches). Hq must be a multiple
            of Hkv; query head ``h`` reads KV head ``h // (Hq // Hkv)``. The
            PyTorch path also takes tiled views [num_blocks, block_size / TL, TL,
            Hkv, D / DL, DL] of layouts that pack tiles of TL tokens and DL
            channels (vLLM's CPU_ATTN under AMX): token ``t`` of a block sits at
            ``(t // TL, t % TL)``, channel ``d`` at ``(d // DL, d % DL)``; the
            two caches may tile differently.
        block_table: [B, max_blocks] int32/int64, logical block -> cache block.
        prefix_lens: [B] int32/int64, committed tokens before the tree. Node
            ``j``'s K/V must already be at logical position ``prefix_len + j``.
        meta: tree metadata (``ancestor_words``, ``depths``, ``num_nodes``).
        scale: logit scale, usually D ** -0.5.
        sliding_window: key at token position ``p`` is visible to a query at
            ``t`` only if ``t - p < sliding_window``; node ``i`` sits at
            ``prefix_len + depth(i)``. None: unlimited.
        logits_soft_cap: logits become ``cap * tanh(logits / cap)`` after scaling.
        backend: ``"auto"`` (Triton on CUDA, PyTorch elsewhere), ``"torch"`` or
            ``"triton"`` (see :func:`triton_ops.utils.use_triton`).
        out: optional [B, N, Hq, D] tensor of q's dtype to write into (any strides).

    Returns:
        [B, N, Hq, D] in q's dtype (``out`` when given); softmax in fp32;
        padded nodes are zeros.
    """
    _check_inputs(q, key_cache, value_cache, block_table, prefix_lens, meta, scale,
                  sliding_window, logits_soft_cap)
    B, N, Hq, D = q.shape
    out = output_buffer(out, q.shape, q.dtype, q.device, "[B, N, Hq, D]")
    if not use_triton(backend, q):
        out.copy_(_tree_attention_torch(q, key_cache, value_cache, block_table, prefix_lens,
                                        meta, scale, sliding_window, logits_soft_cap))
        return out
    launch_tree_attention(q, key_cache, value_cache, block_table, prefix_lens, meta, scale,
                          sliding_window, logits_soft_cap, out,
                          kernel_config(q, cache_geometry(key_cache)[2]))
    return out


def launch_tree_attention(q, key_cache, value_cache, block_table, prefix_lens, meta, scale,
                          sliding_window, logits_soft_cap, out, config: KernelConfig):
    """The two Triton launches with explicit parameters (the benchmark sweeps ``config``).

    Returns the split kernel's compiled handle (registers and spills for the benchmark).
    """
    check_untiled("key_cache", key_cache)
    check_untiled("value_cache", value_cache)
    B, N, Hq, D = q.shape
    Hkv = key_cache.shape[2]
    G = Hq // Hkv
    S = config.num_splits
    part_o = torch.empty(B * Hkv, S, N * G, D, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(B * Hkv, S, N * G, dtype=torch.float32, device=q.device)
    block_d = dot_block(D)
    window = sliding_window if sliding_window is not None else 0
    words = meta.ancestor_words
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    if logits_soft_cap is None:
        qk_scale, soft_cap = scale * LOG2E, 0.0
    else:
        qk_scale, soft_cap = scale * 2.0 * LOG2E / logits_soft_cap, logits_soft_cap * LOG2E
    common = (Hkv, G)
    strides = (*q.stride(), *key_cache.stride(), *value_cache.stride(), *block_table.stride(),
               *meta.depths.stride())
    partial_strides = (*part_o.stride()[:3], *part_lse.stride()[:2])
    flags = dict(HEAD_DIM=D, BLOCK_D=block_d, SOFT_CAP=logits_soft_cap is not None,
                 SLIDING=sliding_window is not None, DOT_PRECISION=precision)
    grid = (triton.cdiv(N * G, config.block_m), S, B * Hkv)
    split_kernel = _tree_attention_split_kernel[grid](
        q, key_cache, value_cache, block_table, prefix_lens, meta.num_nodes, meta.depths,
        part_o, part_lse,
        *common, key_cache.shape[1], S, qk_scale, soft_cap, window,
        *strides, *partial_strides,
        EVEN_D=block_d == D, BLOCK_M=config.block_m, BLOCK_N=config.block_n, MIN_CHUNK=config.min_chunk,
        RESCALE_SLACK=config.rescale_slack, **flags,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    block_t = min(32, dot_block(N))
    block_c = min(MERGE_COLUMNS, block_d)
    _tree_attention_merge_kernel[(triton.cdiv(N * G, MERGE_ROWS), triton.cdiv(D, block_c), B * Hkv)](
        q, key_cache, value_cache, block_table, prefix_lens, meta.num_nodes, meta.depths, words,
        part_o, part_lse, out,
        *common, N * G, key_cache.shape[1], S, qk_scale, soft_cap, window,
        *strides, *words.stride(), *partial_strides, *out.stride(),
        BLOCK_C=block_c, BLOCK_R=MERGE_ROWS, BLOCK_T=block_t, SPLITS_IN_FLIGHT=MERGE_SPLITS_IN_FLIGHT,
        **flags, num_warps=4,
    )
    return split_kernel
