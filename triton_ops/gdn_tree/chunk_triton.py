"""Triton kernels for tree verify and commit (the CUDA path).

With the row blocks r, c of ``SB`` = min(NP, 64) nodes, block forward substitution
solves ``(I + A) Delta = diag(beta) U`` and forms the outputs:

    U_r     = V_r - diag(e^G) K_r S0
    Delta_r = (I + A_rr)^{-1} (diag(beta_r) U_r - sum_{c<r} A_rc Delta_c)
    O_r     = diag(e^G) Q_r S0 + sum_{c<=r} P_rc Delta_c

Two verify kernels compute it, the first in two variants (``default_verify_kernel``
picks one by N and batch):

Tile (``_verify_tile_kernel``), N <= 128: one launch, one program per (request,
value head, block of BV value columns) walks the request's own row blocks (the
first SB rows; past 64 rows a second block of 16 or 64, ``tile_second_block``):
``K S0``, ``Q S0`` with K in chunks of 64, the earlier block's ``A_rc`` and
``P_rc`` recomputed from the keys against its ``Delta_c`` (read back from the output
this program wrote), ``K K^T``, the diagonal solve, ``Q K^T``. Every V block redoes
the key-side products and the solve, which is cheap while the batch is small.

Peeled tile (the same kernel, PEEL = 1): node 0 has no parent, so its row is one
recurrent step from S0 (``Delta_0 = beta_0 (v_0 - e^{g_0} S0^T k_0)``); the row
blocks then cover nodes 1 .. N - 1 and take node 0 as a one-row earlier block,
``A_i0 Delta_0`` and ``P_i0 Delta_0`` under the ancestor mask. This is the
recurrence's ``S_1 = e^{g_0} S0 + k_0 Delta_0^T`` expanded in the products
(``e^{G_i - g_0} K_i S_1 = e^{G_i} K_i S0 + e^{G_i - g_0} (k_i . k_0) Delta_0^T``) but
needs no rooted tree: rows outside node 0's tree get no term. The engine's trees
(a root and a power-of-two budget: 17, 33, 65 nodes) then fit blocks of 16, 32 and
64 rows instead of 32, 64 and 64 + 16 (``peel_shrinks_tile``).

Split, any N: two launches, the split fla's chunk kernels use, so that no kernel
holds the triangular solve and the state products at once; the solve runs once per
head, which wins at large batches:

1. ``_verify_prepare_kernel``, one program per (request, value head, block of
   ``SB`` <= 64 rows): the path sums G, the masked ``A``, its inverse and the
   masked ``Q K^T`` scores, written to a per-head workspace.
2. ``_verify_output_kernel``, one program per (request, value head, block of BV
   value columns): ``K S0`` and ``Q S0``, then ``Delta`` and the outputs with the
   workspace's matrices, row block after row block.

The workspace ``solve`` holds ``T_rr = (I + A_rr)^{-1} diag(beta_r)`` on its diagonal
blocks and ``A_rc / beta_r`` below them, ``scores`` holds ``P_rc`` (``c <= r``).

Peeled split (the same two kernels, PEEL = 1): the workspace covers nodes 1 .. N - 1,
NP = dot_block(N - 1); the output kernel solves node 0 first with the peeled tile
kernel's recurrent step and adds its column to every row block, as the peeled tile
kernel does. At 65 nodes the workspace shrinks from 128 to 64 rows
(``peel_shrinks_split``).

Inside a block, ``(I + A_rr)^{-1}`` is formed from its 16x16 diagonal blocks,
inverted row by row in plain fp32 (stable for repeated keys, where powers of A
explode), merged by forward substitution over the 16-row blocks. Every verify
kernel stops at each request's own node count: padding row blocks cost nothing.

Commit runs one program per (request, value head, K block, V block).

Dot precision (``precision`` = PREC, tf32x3 by default): ``K K^T`` and ``Q K^T``
of 16-bit inputs run natively (exact products, fp32 accumulation), of fp32
inputs at PREC. ``K S0`` and ``Q S0`` of bf16 inputs (PREC not tf32): the fp32
state as three bf16 parts hi + mid + lo (off by < 2^-24 relative) against the exact
bf16 keys, three native dots whose products are exact in the fp32 accumulator:
fp32 accuracy without fp32 copies of K and Q; otherwise at PREC. The merges of
the triangular solve, ``T U``, ``A Delta``, ``P Delta`` and commit's ``K^T Delta`` at PREC.

Path sums G are accumulated and kept in float64; inside the kernels they are
split into fp32 (hi, lo) pairs so that ``G_i - G_j`` is accurate in fp32 (see
``GDNTreeVerifyOutput.gate_sum``).

Shapes are documented in :mod:`.chunk`, which validates the arguments.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton_ops.gdn_tree.chunk import Allocate, GDNTreeVerifyOutput, commit_fields, new_tensor
from triton_ops.tree_metadata import TreeMetadata
from triton_ops.utils import bit_is_set, dot_block, interpreting, layer_tensor

ROW_BLOCK = 16
# Rows of one verify block: the masked A and its inverse stay in registers.
MAX_SUPER_BLOCK = 64
# Key columns of the q / k / state tiles a pass over K loads at a time. At the engine's 65x1
# verify (K = 128, sm_90, the device's Triton 3.6) 128 runs 18 wgmma waits instead of 24
# but spills 464 B instead of 296 (tools/compiled_kernels.py): for the GPU sweep to settle.
K_CHUNK = 64
# The tile kernel's 64-row blocks multiply K and Q by the state's three bf16 parts in one dot
# (dot_parts' FUSE): the engine's 65x1 verify (sm_90, device Triton 3.6) runs 24 wgmma waits
# instead of 32, with the same stack and 6% more code. Smaller blocks run mma.sync, where
# the fused dot only adds registers (33 x 1: 568 B of stack against 112), and the split's
# output kernel spills more with it (65 x 8: 608 against 408 B): they keep three dots.
FUSE_STATE_PARTS = True
# The fused dot runs at this many warps only: at 8 it hit an illegal memory access on an
# H100 under Triton 3.6 (stop 29), probably the peeled kernels' fault below (those runs
# were peeled); at 4 the GPU checked it.
FUSED_PARTS_WARPS = 4
# Most warps a peeled kernel (tile, or the split's output kernel) launches with. At 8,
# compute-sanitizer on an H100 (Triton 3.6.0) reports out-of-bounds shared-memory reads
# inside the compiled kernel (attributed to load_chunk, inlined at several sites), with or
# without the fused parts: peeled tile at 65 x 1, peeled split at 65 x 1 and 65 x 16. The
# same launches at 4 warps, and the unpeeled tile at 64 x 1 with 8, were clean. Shared
# memory is the compiler's to address, so the fault is Triton's (BENCHMARKS.md, stop 31).
PEELED_MAX_WARPS = 4
# Columns of the tile kernel's off-diagonal A_rc / P_rc formed at a time.
CROSS_COLS = 32
# BV = 16 hit an illegal memory access in the earlier tile kernel under Triton 3.6
# on an H200 (cause not established); narrower V is padded to 32 columns instead.
MIN_BLOCK_V = 32


# Largest node count the tile kernels take: two row blocks of MAX_SUPER_BLOCK.
TILE_MAX_NODES = 2 * MAX_SUPER_BLOCK
# Largest node count the dispatch sends to a tile kernel: one block plus a 16-row block
# (tile_second_block); past it the 64-row second block loses to the split (below).
TILE_DISPATCH_MAX_NODES = MAX_SUPER_BLOCK + 16
# "peeled_tile", "peeled_split": the tile kernel and the split with node 0 solved first, as
# one recurrent step.
VERIFY_KERNELS = ("tile", "peeled_tile", "split", "peeled_split")
TILE_KERNELS = ("tile", "peeled_tile")
PEELED_KERNELS = ("peeled_tile", "peeled_split")
# (request, value head) pairs, B * HV, from which the split runs instead of the tile
# kernel: SPLIT_MIN_HEADS for every tree, SPLIT_MIN_HEADS_LARGE for trees of
# SPLIT_LARGE_NODES nodes and more. The rule rests on these cells, measured on the H200
# (BENCHMARKS.md, "Stop 14", "Stop 15", "Stop 19" and "Stop 20 device calls"; bf16 inputs,
# HV = 48, K = V = 128, fp32 state, us per layer under CUDA graphs; each kernel peeled
# where the dispatch would peel it):
#
#     N   B  heads   tile   split
#     16  1     48   12.1    15.9
#     64  1     48   32.6    48.4
#     65  1     48   50.0    63.2
#    128  1     48  103.4    73.7
#     17  8    384   51.6    54.8
#     64  8    384  184.6   172.9
#     65  8    384  262.7   206.9
#     64 32   1536  950.6   594.1
#
# The tile kernel re-solves each head's triangular system in every V block and at 512
# heads and up runs BV = 128 (default_tile_config), a [64, 128] fp32 right-hand side per
# 4-warp program, where it spills; the split solves once per head. At 384 heads the split
# wins from 64 nodes and loses at 17 (the rule's trees at B = 8); 33 is unmeasured and
# stays with the tile kernel. Peeled against plain split at 65 nodes: 374.4 / 614.2 us at
# B = 16, 706.2 / 1194.9 at B = 32 ("Stop 19").
SPLIT_MIN_HEADS = 512
SPLIT_MIN_HEADS_LARGE = 384
SPLIT_LARGE_NODES = 64


def default_verify_kernel(N: int, heads: int) -> str:
    """The verify kernel for N nodes and B * HV heads: a tile kernel for small batches of
    up to TILE_DISPATCH_MAX_NODES nodes (one launch, no workspace), the split otherwise;
    each peeled where that shrinks its row blocks (:func:`peel_shrinks_tile`,
    :func:`peel_shrinks_split`; 65 nodes at batch 16 or 32: 64 workspace rows instead of
    128, 1.6-1.7x faster on the H200)."""
    split_min_heads = SPLIT_MIN_HEADS_LARGE if N >= SPLIT_LARGE_NODES else SPLIT_MIN_HEADS
    if N > TILE_DISPATCH_MAX_NODES or heads >= split_min_heads:
        return "peeled_split" if peel_shrinks_split(N) else "split"
    return "peeled_tile" if peel_shrinks_tile(N) else "tile"


def kernel_takes(kernel: str, N: int) -> bool:
    """Whether verify kernel ``kernel`` takes trees of N nodes (the tile kernels: two row
    blocks of at most MAX_SUPER_BLOCK rows)."""
    return kernel not in TILE_KERNELS or N <= TILE_MAX_NODES


def kernel_takes_warps(kernel: str, num_warps: int) -> bool:
    """Whether verify kernel ``kernel`` may launch its tile or output kernel with
    ``num_warps`` warps (:data:`PEELED_MAX_WARPS`)."""
    return kernel not in PEELED_KERNELS or num_warps <= PEELED_MAX_WARPS


def tile_blocks(rows: int) -> tuple[int, int]:
    """Rows of the tile kernel's first and second row block for ``rows`` rows."""
    return min(dot_block(rows), MAX_SUPER_BLOCK), tile_second_block(rows)


def peel_shrinks_tile(N: int) -> bool:
    """Whether solving node 0 first leaves the tile kernel smaller row blocks for the other
    N - 1 nodes: for N = 2^k + 1 from 17 up, the engine's trees (a root and a power-of-two
    budget). At 65 nodes it drops the 16-row second block (H200, Qwen3.6-27B shapes, B = 1:
    64 nodes 31-32 us, 65 unpeeled 50 us); at 17 and 33 it halves the one block."""
    return N > 1 and tile_blocks(N - 1) != tile_blocks(N)


def peel_shrinks_split(N: int) -> bool:
    """Whether solving node 0 first shrinks the split's workspace side NP = dot_block(rows)
    for the other N - 1 nodes: N = 2^k + 1 from 17 up (65 nodes: 128 -> 64 rows, a quarter of
    the workspace and half the row blocks)."""
    return N > 1 and dot_block(N - 1) != dot_block(N)


def tile_second_block(N: int) -> int:
    """Rows of the tile kernel's second row block for N rows, 0 for N <= 64: 16 up to 80
    rows, else 64. Not 32: that block spilled 3x more than either (sm_90 spill stack,
    Triton 3.9 on the CPU machine, BV = 32, 4 warps: 16 rows 480 B, 32 rows 1472 B, 64
    rows 784 B; one block, N <= 64: 256 B)."""
    if N <= MAX_SUPER_BLOCK:
        return 0
    return ROW_BLOCK if N <= MAX_SUPER_BLOCK + ROW_BLOCK else MAX_SUPER_BLOCK


def fuses_parts(fuse_parts: bool, num_warps: int) -> bool:
    """Whether a tile launch of ``num_warps`` asked for ``fuse_parts`` multiplies the
    state's parts in one dot (:data:`FUSED_PARTS_WARPS`)."""
    return fuse_parts and num_warps == FUSED_PARTS_WARPS


def default_tile_config(heads: int, V: int) -> tuple[int, int]:
    """(BV, num_warps) of the tile kernel: split V finely while the batch is small
    so that the programs cover the GPU; every program re-solves its head's
    triangular system, which is cheap next to the value-side products."""
    BV = 32 if heads < 128 else 64 if heads < 512 else 128
    return max(MIN_BLOCK_V, min(BV, dot_block(V))), 4


def default_output_config(heads: int, V: int) -> tuple[int, int]:
    """(BV, num_warps) of the output kernel: split V finely while the batch is
    small so that the programs cover the GPU."""
    BV = 32 if heads < 512 else 64
    return max(MIN_BLOCK_V, min(BV, dot_block(V))), 4


@triton.jit
def load_rows(ptr, rows, cols, stride_r, stride_c, n_rows, n_cols):
    """[len(rows), len(cols)] fp32 tile; zero outside ``rows < n_rows, cols < n_cols``."""
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    return tl.load(ptr + rows[:, None] * stride_r + cols[None, :] * stride_c, mask=mask, other=0.0).to(
        tl.float32
    )


@triton.jit
def load_chunk(ptr, rows, cols, stride_r, stride_c, n_rows, n_cols):
    """Like :func:`load_rows` but in the stored dtype."""
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    return tl.load(ptr + rows[:, None] * stride_r + cols[None, :] * stride_c, mask=mask, other=0.0)


@triton.jit
def l2_normalize_rows(x, USE_L2: tl.constexpr):
    if USE_L2:
        x = x * (1.0 / tl.sqrt(tl.sum(x * x, axis=1) + 1e-6))[:, None]
    return x


@triton.jit
def ancestor_bits(words, row_base, rows, cols, W, n_valid):
    """[len(rows), len(cols)] bool: ``cols[j]`` is ``rows[i]`` or one of its ancestors.

    ``words`` is the [B, N, W] int64 bitset table; ``row_base`` = b * N.
    """
    mask = (rows[:, None] < n_valid) & (cols[None, :] < n_valid)
    w = tl.load(words + (row_base + rows[:, None]) * W + cols[None, :] // 64, mask=mask, other=0)
    return bit_is_set(w, cols[None, :])


@triton.jit
def dot_raw(x, y, PREC: tl.constexpr, LOWP: tl.constexpr):
    """x @ y in fp32: 16-bit operands multiply natively (their products are exact
    in the fp32 accumulator), fp32 operands at precision PREC."""
    if LOWP:
        return tl.dot(x, y)
    return tl.dot(x.to(tl.float32), y.to(tl.float32), input_precision=PREC)


@triton.jit
def bf16_parts(s0, SPLIT: tl.constexpr):
    """(hi, mid, lo) bf16 parts of the fp32 ``s0`` when SPLIT, else ``s0`` three
    times (no copies). Each rounding to 8 significant bits leaves at most 2^-8 of
    what it rounds, so hi + mid + lo is within 2^-24 of ``s0``: fp32's own rounding."""
    if SPLIT:
        hi = s0.to(tl.bfloat16)
        rest = s0 - hi.to(tl.float32)
        mid = rest.to(tl.bfloat16)
        lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)
    else:
        hi = s0
        mid = s0
        lo = s0
    return hi, mid, lo


@triton.jit
def dot_parts(x, hi, mid, lo, acc, PREC: tl.constexpr, SPLIT: tl.constexpr, NATIVE: tl.constexpr,
              FUSE: tl.constexpr):
    """``acc + x @ s0`` with ``s0`` given by :func:`bf16_parts`: SPLIT (bf16 ``x``)
    multiplies the three parts natively, each product exact in the fp32 accumulator; else
    one dot at PREC. SPLIT runs three dots, smallest part first, or with FUSE one dot of
    four times the depth: ``x`` repeated four times along K against the parts and a zero
    part interleaved (one wait for the result instead of three where a dot is a wgmma, but
    more registers: see verify_triton's ``fuse_parts``). NATIVE is False in the interpreter,
    whose bf16 ``tl.dot`` is broken: there the same operands multiply as fp32."""
    if SPLIT:
        if FUSE:
            R: tl.constexpr = x.shape[0]
            C: tl.constexpr = x.shape[1]
            twice = tl.reshape(tl.join(x, x), [R, 2 * C])
            x = tl.reshape(tl.join(twice, twice), [R, 4 * C])  # column 4i + j holds x_i
            # [C, V, 2, 2] -> [C, 2, 2, V] -> row 4i + j holds part j of row i: hi, mid, lo, 0.
            parts = tl.join(tl.join(hi, mid), tl.join(lo, tl.zeros_like(lo)))
            parts = tl.reshape(tl.permute(parts, [0, 3, 2, 1]), [4 * C, hi.shape[1]])
            if NATIVE:
                acc = tl.dot(x, parts, acc)
            else:
                acc = tl.dot(x.to(tl.float32), parts.to(tl.float32), acc, input_precision="ieee")
        elif NATIVE:
            acc = tl.dot(x, lo, acc)
            acc = tl.dot(x, mid, acc)
            acc = tl.dot(x, hi, acc)
        else:
            xf = x.to(tl.float32)
            acc = tl.dot(xf, lo.to(tl.float32), acc, input_precision="ieee")
            acc = tl.dot(xf, mid.to(tl.float32), acc, input_precision="ieee")
            acc = tl.dot(xf, hi.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(x.to(tl.float32), hi, acc, input_precision=PREC)
    return acc


@triton.jit
def first_column(x, COLUMNS: tl.constexpr):
    """[len(x), COLUMNS]: ``x`` in column 0, zeros elsewhere. A dot against it takes one
    column of products (16 columns: the narrowest dot) without a row sum."""
    first = tl.arange(0, COLUMNS) == 0
    return tl.where(first[None, :], x[:, None], tl.zeros([x.shape[0], COLUMNS], dtype=x.dtype))


@triton.jit
def path_sums(g, stride_gn, words, row_base, rows, n_b, W, BT: tl.constexpr):
    """G of ``rows`` in float64: the sum of g over each node and its ancestors,
    which precede it (topological order), in BT-column slices. Each slice is a float64 dot
    of the 0/1 ancestor bits against g as the first of 16 columns (products exact, float64
    sums): a float64 row sum of the [rows, BT] slice compiled to ~700 sm_90 instructions."""
    acc = tl.zeros([rows.shape[0], 16], dtype=tl.float64)
    last = tl.minimum(tl.max(rows) + 1, n_b)
    for c in range(0, tl.cdiv(last, BT)):
        cols = c * BT + tl.arange(0, BT)
        g_c = tl.load(g + cols * stride_gn, mask=cols < n_b, other=0.0).to(tl.float64)
        # A slice of BT (which divides 64) columns lies in one bitset word: one load a row.
        w = tl.load(words + (row_base + rows) * W + (c * BT) // 64, mask=rows < n_b, other=0)
        bits = bit_is_set(w[:, None], cols[None, :]) & (cols[None, :] < n_b)
        acc = tl.dot(tl.where(bits, 1.0, 0.0).to(tl.float64), first_column(g_c, 16), acc, out_dtype=tl.float64)
    return tl.sum(acc, axis=1)


@triton.jit
def masked_decay(pairs, gr_hi, gr_lo, gc_hi, gc_lo):
    """``exp(G_i - G_j)`` where ``pairs`` (ancestor or self), else 0, with G given as
    fp32 (hi, lo) halves (:func:`fp32_pair`) whose differences are exact enough. The
    mask goes inside the exponent: non-ancestor differences may be thousands of
    nats, where ``exp(.) * 0`` is ``inf * 0``."""
    diff = (gr_hi[:, None] - gc_hi[None, :]) + (gr_lo[:, None] - gc_lo[None, :])
    return tl.exp(tl.where(pairs, diff, float("-inf")))


@triton.jit
def word_bits(lo, hi, cols):
    """[NP, len(cols)] bool: bit ``cols[j]`` of each row's 64-bit word given as int32 halves."""
    half = tl.where(cols[None, :] < 32, lo[:, None], hi[:, None])
    return ((half >> (cols[None, :] % 32)) & 1) != 0


@triton.jit
def word_halves(words, row_base, rows, c, W, n_valid, SHIFT: tl.constexpr):
    """Columns ``64 c + SHIFT .. 64 c + SHIFT + 63`` of each row's ancestor bitset as int32
    halves (int64 tiles cost twice the registers); 0 past ``n_valid``. SHIFT = 1 is the
    peeled tile kernel's window, whose row blocks start one node later."""
    w = tl.load(words + (row_base + rows) * W + c, mask=rows < n_valid, other=0)
    if SHIFT > 0:
        upper_valid = tl.where(c + 1 < W, n_valid, 0)  # no word past the last
        upper = tl.load(words + (row_base + rows) * W + c + 1, mask=rows < upper_valid, other=0)
        # >> on int64 copies the sign bit: clear the SHIFT bits it fills before merging.
        w = ((w >> SHIFT) & ((1 << (64 - SHIFT)) - 1)) | (upper << (64 - SHIFT))
    return w.to(tl.int32), (w >> 32).to(tl.int32)


@triton.jit
def fp32_pair(x):
    """float64 ``x`` as fp32 (hi, lo) with ``hi + lo`` = ``x`` to ~2^-48 relative."""
    x_hi = x.to(tl.float32)
    return x_hi, (x - x_hi.to(tl.float64)).to(tl.float32)


@triton.jit
def diagonal_blocks(a, NB: tl.constexpr, BT: tl.constexpr):
    """[NB, BT, BT]: the BT x BT diagonal blocks of the [NB * BT, NB * BT] ``a``."""
    blk = tl.arange(0, NB)
    same = blk[:, None, None, None] == blk[None, None, :, None]
    return tl.sum(tl.where(same, tl.reshape(a, [NB, BT, NB, BT]), 0.0), axis=2)


@triton.jit
def batched_unit_lower_inverse(a3, NB: tl.constexpr, BT: tl.constexpr):
    """``(I + a3[n])^{-1}`` of NB strictly lower triangular BT x BT blocks at once,
    one row position per step (``T_i = e_i - sum_{j<i} a_ij T_j``, plain fp32)."""
    pos = tl.arange(0, BT)
    row = pos[None, :, None]
    t3 = tl.where(row == pos[None, None, :], 1.0, 0.0) + tl.zeros([NB, BT, BT], dtype=tl.float32)
    # A loop, not unrolled: each step needs the last, and unrolled the 15 steps were ~1.3k
    # of the engine's 65-node verify's 10.9k sm_90 instructions.
    for i in range(1, BT):
        a_i = tl.sum(tl.where(row == i, a3, 0.0), axis=1)
        t_i = tl.where(pos[None, :] == i, 1.0, 0.0) - tl.sum(a_i[:, :, None] * t3, axis=1)
        t3 = tl.where(row == i, t_i[:, None, :], t3)
    return t3


@triton.jit
def block_forward_solve(a, rhs, NP: tl.constexpr, BT: tl.constexpr, PREC: tl.constexpr):
    """``(I + a)^{-1} rhs`` for strictly lower triangular ``a`` [NP, NP] and ``rhs``
    [NP, W]: the BT x BT diagonal blocks D_r inverted together, then block row r
    ``X_r = D_r^{-1} (rhs_r - a_{r,<r} X_{<r})`` over the rows already final. The
    inverses stay [NB, BT, BT] and a batched dot applies them (a broadcast into an
    [NP, NP] block-diagonal tile spilled 5x more on sm_90); ``a`` without its
    diagonal blocks reaches block row r only through the final ``X_{<r}``."""
    NB: tl.constexpr = NP // BT
    W: tl.constexpr = rhs.shape[1]
    blk = tl.arange(0, NP) // BT
    d3 = batched_unit_lower_inverse(diagonal_blocks(a, NB, BT), NB, BT)
    a_off = tl.where(blk[:, None] == blk[None, :], 0.0, a)
    x = tl.reshape(tl.dot(d3, tl.reshape(rhs, [NB, BT, W]), input_precision=PREC), [NP, W])
    for r in range(1, NB):  # a loop, not unrolled, as in batched_unit_lower_inverse
        y = tl.reshape(rhs - tl.dot(a_off, x, input_precision=PREC), [NB, BT, W])
        x = tl.where(blk[:, None] == r, tl.reshape(tl.dot(d3, y, input_precision=PREC), [NP, W]), x)
    return x


@triton.jit
def tile_root_row(
    q, k, v, g, beta, state, o, delta, gate_sum, k_normed,
    stride_qk, stride_kk, stride_vv, stride_sk, stride_sv, scale, cv, write_k, K, V,
    BK: tl.constexpr, BKC: tl.constexpr, BV: tl.constexpr, USE_L2: tl.constexpr,
):
    """Node 0 of the peeled kernels (pointers at the request and head): a root (its
    parent index is below 0), so one recurrent step from S0 gives its row,

        Delta_0 = beta_0 (v_0 - e^{g_0} S0^T k_0),   o_0 = e^{g_0} S0^T q_0 + (q_0 . k_0) Delta_0,

    in fp32 FMAs (a single row makes no dot). Returns (Delta_0 [BV], 1 / |k_0|, g_0), what
    the row blocks need to add its column."""
    ks = tl.zeros([BV], dtype=tl.float32)
    qs = tl.zeros([BV], dtype=tl.float32)
    k_sq = tl.zeros([BKC], dtype=tl.float32)
    q_sq = tl.zeros([BKC], dtype=tl.float32)
    qk = tl.zeros([BKC], dtype=tl.float32)
    for c in tl.static_range(BK // BKC):
        ck = c * BKC + tl.arange(0, BKC)
        s0 = load_rows(state, ck, cv, stride_sk, stride_sv, K, V)
        k0 = tl.load(k + ck * stride_kk, mask=ck < K, other=0.0).to(tl.float32)
        q0 = tl.load(q + ck * stride_qk, mask=ck < K, other=0.0).to(tl.float32)
        ks += tl.sum(k0[:, None] * s0, axis=0)
        qs += tl.sum(q0[:, None] * s0, axis=0)
        k_sq += k0 * k0
        q_sq += q0 * q0
        qk += q0 * k0
    rk = 1.0 / tl.sqrt(tl.sum(k_sq) + 1e-6) if USE_L2 else tl.full([], 1.0, dtype=tl.float32)
    rq = scale / tl.sqrt(tl.sum(q_sq) + 1e-6) if USE_L2 else tl.full([], scale, dtype=tl.float32)
    g0 = tl.load(g).to(tl.float32)
    e_g = tl.exp(g0)
    v0 = tl.load(v + cv * stride_vv, mask=cv < V, other=0.0).to(tl.float32)
    d0 = tl.load(beta).to(tl.float32) * (v0 - e_g * rk * ks)
    tl.store(delta + cv, d0, mask=cv < V)
    tl.store(o + cv, (e_g * rq * qs + rq * rk * tl.sum(qk) * d0).to(o.dtype.element_ty), mask=cv < V)
    tl.store(gate_sum, g0.to(tl.float64))
    if write_k:
        for c in tl.static_range(BK // BKC):
            ck = c * BKC + tl.arange(0, BKC)
            k0 = tl.load(k + ck * stride_kk, mask=ck < K, other=0.0).to(tl.float32)
            tl.store(k_normed + ck, k0 * rk, mask=ck < K)
    return d0, rk, g0


@triton.jit
def root_products(q, k, stride_qn, stride_qk, stride_kn, stride_kk, rows, n_b, K,
                  BK: tl.constexpr, BKC: tl.constexpr, PREC: tl.constexpr, LOWP: tl.constexpr):
    """(k_i . k_0, q_i . k_0) of ``rows``, raw (unnormalised): node 0's column of the peeled
    kernels' A and P before the norms and the decay. Dots against k_0 as the first of 16
    columns (the smallest dot), not row sums: an fp32 row sum of a [rows, BKC] tile compiled
    to ~450 sm_90 instructions, the dot and its 16-column sum to a tenth of that."""
    k_k0 = tl.zeros([rows.shape[0], 16], dtype=tl.float32)
    q_k0 = tl.zeros([rows.shape[0], 16], dtype=tl.float32)
    for j in tl.static_range(BK // BKC):
        ck = j * BKC + tl.arange(0, BKC)
        k0_column = first_column(tl.load(k + ck * stride_kk, mask=ck < K, other=0.0), 16)
        k_k0 = k_k0 + dot_raw(load_chunk(k, rows, ck, stride_kn, stride_kk, n_b, K), k0_column, PREC, LOWP)
        q_k0 = q_k0 + dot_raw(load_chunk(q, rows, ck, stride_qn, stride_qk, n_b, K), k0_column, PREC, LOWP)
    return tl.sum(k_k0, axis=1), tl.sum(q_k0, axis=1)


@triton.jit
def add_root_column(rhs, b_o, d0, a_scale, p_scale, g0, words, row_base, rows, W, n_b, gr_hi, gr_lo):
    """``rhs - A_i0 Delta_0`` and ``b_o + P_i0 Delta_0`` for ``rows`` of a peeled kernel: node
    0's column, masked to its descendants (in a forest the other rows never see it).
    ``a_scale`` and ``p_scale`` are A_i0 and P_i0 before the decay (the norms, and beta where
    ``rhs`` carries it, applied to :func:`root_products`): the split's ``rhs`` is U, before
    beta, so it passes A_i0 / beta_i."""
    root = tl.zeros([1], dtype=tl.int32)
    g_root = tl.zeros([1], dtype=tl.float32) + g0  # G_0 = g_0: a root sums its own gate only
    decay = masked_decay(ancestor_bits(words, row_base, rows, root, W, n_b), gr_hi, gr_lo, g_root, g_root * 0)
    rhs -= (a_scale[:, None] * decay) * d0[None, :]
    b_o += (p_scale[:, None] * decay) * d0[None, :]
    return rhs, b_o


@triton.jit
def tile_row_block(
    q, k, v, g, beta, state, words, o, delta, gate_sum, k_normed,
    stride_qn, stride_qk, stride_kn, stride_kk, stride_vn, stride_vv, stride_gn, stride_bn,
    stride_sk, stride_sv, scale, b, n_b, cv, write_k, N, H, HV, K, V, W, d0, rk0, g0,
    r: tl.constexpr, R: tl.constexpr, SB: tl.constexpr, PEEL: tl.constexpr, CB: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BKC: tl.constexpr, BV: tl.constexpr, USE_L2: tl.constexpr,
    PREC: tl.constexpr, LOWP_QK: tl.constexpr, SPLIT_S0: tl.constexpr, NATIVE: tl.constexpr,
    FUSE_PARTS: tl.constexpr,
):
    """Row block ``r`` of the tile kernel: its R rows from ``PEEL + r * SB`` (pointers
    already at the request and head); zeros when the request ends before it. PEEL: node
    0 was solved by :func:`tile_root_row`, whose ``Delta_0``, ``1 / |k_0|`` and ``g_0``
    (= G_0) enter as a one-row earlier block."""
    pos = tl.arange(0, R)
    rows = PEEL + r * SB + pos
    if PEEL + r * SB < n_b:
        live = rows < n_b
        # G in float64, kept as an fp32 (hi, lo) pair, so that G_i - G_j is accurate in fp32.
        g_r = path_sums(g, stride_gn, words, b * N, rows, n_b, W, BT)
        tl.store(gate_sum + rows * HV, g_r, mask=rows < N)
        gr_hi, gr_lo = fp32_pair(g_r)

        if PEEL:  # before the state products, while few tiles are alive (sm_90 spills 648 -> 504 B)
            k_k0, q_k0 = root_products(q, k, stride_qn, stride_qk, stride_kn, stride_kk, rows, n_b, K, BK, BKC,
                                       PREC, LOWP_QK)

        # Passes over K in chunks of BKC, each keeping few tiles alive (register pressure,
        # not bandwidth, limits this kernel; the re-reads of q and k hit cache): K S0, Q S0
        # and the norms -> right-hand side; the earlier blocks' terms; K K^T -> A; solve;
        # Q K^T. L2 normalisation is applied to the raw products afterwards.
        ks = tl.zeros([R, BV], dtype=tl.float32)
        qs = tl.zeros([R, BV], dtype=tl.float32)
        k_sq = tl.zeros([R], dtype=tl.float32)
        q_sq = tl.zeros([R], dtype=tl.float32)
        FUSE: tl.constexpr = FUSE_PARTS and R == 64  # where the dots are wgmma (FUSE_STATE_PARTS)
        for c in tl.static_range(BK // BKC):
            ck = c * BKC + tl.arange(0, BKC)
            s0 = load_rows(state, ck, cv, stride_sk, stride_sv, K, V)
            s_hi, s_mid, s_lo = bf16_parts(s0, SPLIT_S0)
            b_k = load_chunk(k, rows, ck, stride_kn, stride_kk, n_b, K)
            ks = dot_parts(b_k, s_hi, s_mid, s_lo, ks, PREC, SPLIT_S0, NATIVE, FUSE)
            k_sq += tl.sum(b_k.to(tl.float32) * b_k.to(tl.float32), axis=1)
            b_q = load_chunk(q, rows, ck, stride_qn, stride_qk, n_b, K)
            qs = dot_parts(b_q, s_hi, s_mid, s_lo, qs, PREC, SPLIT_S0, NATIVE, FUSE)
            q_sq += tl.sum(b_q.to(tl.float32) * b_q.to(tl.float32), axis=1)
        rk = 1.0 / tl.sqrt(k_sq + 1e-6) if USE_L2 else tl.full([R], 1.0, dtype=tl.float32)
        rq = scale / tl.sqrt(q_sq + 1e-6) if USE_L2 else tl.full([R], scale, dtype=tl.float32)
        b_beta = tl.load(beta + rows * stride_bn, mask=live, other=0.0).to(tl.float32)
        e_g = tl.exp(gr_hi)
        b_v = load_rows(v, rows, cv, stride_vn, stride_vv, n_b, V)
        rhs = b_beta[:, None] * (b_v - (e_g * rk)[:, None] * ks)
        b_o = (e_g * rq)[:, None] * qs
        if PEEL:
            rhs, b_o = add_root_column(rhs, b_o, d0, b_beta * rk * rk0 * k_k0, rq * rk0 * q_k0, g0,
                                       words, b * N, rows, W, n_b, gr_hi, gr_lo)

        # Earlier blocks c < r (trees past 64 nodes): rhs_r -= A_rc Delta_c, O_r += P_rc Delta_c,
        # CB columns of A_rc and P_rc at a time, in one pass over K (whole [SB, SB] tiles in
        # two passes spilled 1.4x more on sm_90).
        for c in tl.static_range(r):
            for cb in tl.static_range(SB // CB):
                cols = PEEL + c * SB + cb * CB + tl.arange(0, CB)
                gc_hi, gc_lo = fp32_pair(tl.load(gate_sum + cols * HV))
                lo, hi = word_halves(words, b * N, rows, c, W, n_b, PEEL)
                decay = masked_decay(word_bits(lo, hi, cb * CB + tl.arange(0, CB)), gr_hi, gr_lo, gc_hi, gc_lo)
                kk = tl.zeros([R, CB], dtype=tl.float32)
                qk = tl.zeros([R, CB], dtype=tl.float32)
                kc_sq = tl.zeros([CB], dtype=tl.float32)
                for j in tl.static_range(BK // BKC):
                    ck = j * BKC + tl.arange(0, BKC)
                    b_kc = tl.trans(load_chunk(k, cols, ck, stride_kn, stride_kk, n_b, K))
                    kk += dot_raw(load_chunk(k, rows, ck, stride_kn, stride_kk, n_b, K), b_kc, PREC, LOWP_QK)
                    qk += dot_raw(load_chunk(q, rows, ck, stride_qn, stride_qk, n_b, K), b_kc, PREC, LOWP_QK)
                    kc_sq += tl.sum(b_kc.to(tl.float32) * b_kc.to(tl.float32), axis=0)
                rkc = 1.0 / tl.sqrt(kc_sq + 1e-6) if USE_L2 else tl.full([CB], 1.0, dtype=tl.float32)
                d_c = load_rows(delta, cols, cv, HV * V, 1, N, V)
                rhs -= tl.dot(kk * ((b_beta * rk)[:, None] * rkc[None, :]) * decay, d_c, input_precision=PREC)
                b_o += tl.dot(qk * (rq[:, None] * rkc[None, :]) * decay, d_c, input_precision=PREC)

        # The diagonal block: (I + A_rr) Delta_r = rhs_r, then O_r += P_rr Delta_r.
        lo, hi = word_halves(words, b * N, rows, r, W, n_b, PEEL)
        decay = masked_decay(word_bits(lo, hi, pos), gr_hi, gr_lo, gr_hi, gr_lo)
        kk = tl.zeros([R, R], dtype=tl.float32)
        for j in tl.static_range(BK // BKC):
            b_k = load_chunk(k, rows, j * BKC + tl.arange(0, BKC), stride_kn, stride_kk, n_b, K)
            kk += dot_raw(b_k, tl.trans(b_k), PREC, LOWP_QK)
        a = tl.where(pos[:, None] > pos[None, :], kk * (rk[:, None] * rk[None, :]) * decay * b_beta[:, None], 0.0)
        d = block_forward_solve(a, rhs, R, BT, PREC)

        qk = tl.zeros([R, R], dtype=tl.float32)
        for j in tl.static_range(BK // BKC):
            ck = j * BKC + tl.arange(0, BKC)
            b_k = load_chunk(k, rows, ck, stride_kn, stride_kk, n_b, K)
            qk += dot_raw(load_chunk(q, rows, ck, stride_qn, stride_qk, n_b, K), tl.trans(b_k), PREC, LOWP_QK)
            if write_k:
                tl.store(
                    k_normed + rows[:, None] * H * K + ck[None, :],
                    b_k.to(tl.float32) * rk[:, None], mask=(rows[:, None] < N) & (ck[None, :] < K),
                )
        b_o += tl.dot(qk * (rq[:, None] * rk[None, :]) * decay, d, input_precision=PREC)
        at = rows[:, None] * HV * V + cv[None, :]
        out_mask = (rows[:, None] < N) & (cv[None, :] < V)
        tl.store(delta + at, d, mask=out_mask)
        tl.store(o + at, b_o.to(o.dtype.element_ty), mask=out_mask)
        tl.debug_barrier()
    else:  # row blocks past the last real node: zeros, as documented for padding
        at = rows[:, None] * HV * V + cv[None, :]
        out_mask = (rows[:, None] < N) & (cv[None, :] < V)
        zeros = tl.zeros([R, BV], dtype=tl.float32)
        tl.store(delta + at, zeros, mask=out_mask)
        tl.store(o + at, zeros.to(o.dtype.element_ty), mask=out_mask)
        tl.store(gate_sum + rows * HV, tl.zeros([R], dtype=tl.float64), mask=rows < N)
        if write_k:
            for j in tl.static_range(BK // BKC):
                ck = j * BKC + tl.arange(0, BKC)
                tl.store(k_normed + rows[:, None] * H * K + ck[None, :], tl.zeros([R, BKC], dtype=tl.float32),
                         mask=(rows[:, None] < N) & (ck[None, :] < K))


@triton.jit
def _verify_tile_kernel(
    q, k, v, g, beta, state, slots, words, num_nodes,
    o, delta, gate_sum, k_normed,
    stride_qb, stride_qn, stride_qh, stride_qk,
    stride_kb, stride_kn, stride_kh, stride_kk,
    stride_vb, stride_vn, stride_vh, stride_vv,
    stride_gb, stride_gn, stride_gh,
    stride_bb, stride_bn, stride_bh,
    stride_ss, stride_sh, stride_sk, stride_sv,
    scale, N, HV, K, V, W,
    GROUP: tl.constexpr, SB: tl.constexpr, SB2: tl.constexpr, PEEL: tl.constexpr, CB: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BKC: tl.constexpr, BV: tl.constexpr, USE_L2: tl.constexpr,
    PREC: tl.constexpr, LOWP_QK: tl.constexpr, SPLIT_S0: tl.constexpr, NATIVE: tl.constexpr,
    FUSE_PARTS: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1)
    b = (i_bh // HV).to(tl.int64)
    hv = i_bh % HV
    h = hv // GROUP
    H = HV // GROUP
    n_b = tl.load(num_nodes + b)
    slot = tl.load(slots + b).to(tl.int64)
    cv = i_v * BV + tl.arange(0, BV)
    q += b * stride_qb + h * stride_qh
    k += b * stride_kb + h * stride_kh
    v += b * stride_vb + hv * stride_vh
    g += b * stride_gb + hv * stride_gh
    beta += b * stride_bb + hv * stride_bh
    state += slot * stride_ss + hv * stride_sh
    gate_sum += b * N * HV + hv
    k_normed += b * N * H * K + h * K
    out = b * N * HV * V + hv * V
    o += out
    delta += out
    write_k = (i_v == 0) & (hv % GROUP == 0)  # one program per key head stores the keys
    # PEEL: node 0 first, as one recurrent step (any request's node 0 is a root), then the
    # row blocks from node 1 with its column added: block 0 holds rows PEEL .. PEEL + SB - 1,
    # block 1 (SB2 > 0: past 64 rows) the next SB2, sized to the batch's largest tree, not
    # to 64. Block 0's rows are final once this program has stored them: block 1 reads back
    # their G and Delta (other programs of the head write the same G, other V columns).
    d0, rk0, g0 = None, None, None
    if PEEL:
        d0, rk0, g0 = tile_root_row(
            q, k, v, g, beta, state, o, delta, gate_sum, k_normed,
            stride_qk, stride_kk, stride_vv, stride_sk, stride_sv, scale, cv, write_k, K, V,
            BK, BKC, BV, USE_L2,
        )
    tile_row_block(
        q, k, v, g, beta, state, words, o, delta, gate_sum, k_normed,
        stride_qn, stride_qk, stride_kn, stride_kk, stride_vn, stride_vv, stride_gn, stride_bn,
        stride_sk, stride_sv, scale, b, n_b, cv, write_k, N, H, HV, K, V, W, d0, rk0, g0,
        0, SB, SB, PEEL, CB, BT, BK, BKC, BV, USE_L2, PREC, LOWP_QK, SPLIT_S0, NATIVE, FUSE_PARTS,
    )
    if SB2 > 0:
        tile_row_block(
            q, k, v, g, beta, state, words, o, delta, gate_sum, k_normed,
            stride_qn, stride_qk, stride_kn, stride_kk, stride_vn, stride_vv, stride_gn, stride_bn,
            stride_sk, stride_sv, scale, b, n_b, cv, write_k, N, H, HV, K, V, W, d0, rk0, g0,
            1, SB2, SB, PEEL, CB, BT, BK, BKC, BV, USE_L2, PREC, LOWP_QK, SPLIT_S0, NATIVE, FUSE_PARTS,
        )


@triton.jit
def _verify_prepare_kernel(
    q, k, g, beta, words, num_nodes,
    gate_sum, k_normed, solve, scores,
    stride_qb, stride_qn, stride_qh, stride_qk,
    stride_kb, stride_kn, stride_kh, stride_kk,
    stride_gb, stride_gn, stride_gh,
    stride_bb, stride_bn, stride_bh,
    scale, N, HV, K, W,
    GROUP: tl.constexpr, NP: tl.constexpr, SB: tl.constexpr, PEEL: tl.constexpr, BT: tl.constexpr,
    BK: tl.constexpr, BKC: tl.constexpr, USE_L2: tl.constexpr, PREC: tl.constexpr, LOWP_QK: tl.constexpr,
):
    i_r = tl.program_id(0)
    i_bh = tl.program_id(1)
    b = (i_bh // HV).to(tl.int64)
    hv = i_bh % HV
    h = hv // GROUP
    H = HV // GROUP
    n_b = tl.load(num_nodes + b)
    # PEEL: the workspace holds nodes 1 .. N - 1 (node 0 is the output kernel's recurrent
    # step), so workspace position p is node PEEL + p.
    pos = i_r * SB + tl.arange(0, SB)
    rows = PEEL + pos
    q += b * stride_qb + h * stride_qh
    k += b * stride_kb + h * stride_kh
    g += b * stride_gb + hv * stride_gh
    beta += b * stride_bb + hv * stride_bh
    solve += i_bh.to(tl.int64) * NP * NP
    scores += i_bh.to(tl.int64) * NP * NP

    # Padding rows get G = 0 and zero keys: their loads are masked off.
    g_r = path_sums(g, stride_gn, words, b * N, rows, n_b, W, BT)
    tl.store(gate_sum + b * N * HV + hv + rows * HV, g_r, mask=rows < N)
    gr_hi, gr_lo = fp32_pair(g_r)
    k_sq = tl.zeros([SB], dtype=tl.float32)
    for j in tl.static_range(BK // BKC):
        k_f32 = load_rows(k, rows, j * BKC + tl.arange(0, BKC), stride_kn, stride_kk, n_b, K)
        k_sq += tl.sum(k_f32 * k_f32, axis=1)
    rk = 1.0 / tl.sqrt(k_sq + 1e-6) if USE_L2 else tl.full([SB], 1.0, dtype=tl.float32)
    if hv % GROUP == 0:  # one program per key head stores the keys commit reads
        for j in tl.static_range(BK // BKC):
            ck_store = j * BKC + tl.arange(0, BKC)
            k_f32 = load_rows(k, rows, ck_store, stride_kn, stride_kk, n_b, K)
            tl.store(
                k_normed + b * N * H * K + h * K + rows[:, None] * H * K + ck_store[None, :],
                k_f32 * rk[:, None], mask=(rows[:, None] < N) & (ck_store[None, :] < K),
            )

    if PEEL + i_r * SB < n_b:
        b_beta = tl.load(beta + rows * stride_bn, mask=rows < n_b, other=0.0).to(tl.float32)
        # Earlier blocks c < r: A_rc / beta_r and P_rc (only trees past SB nodes).
        for c in range(0, i_r):
            cols_pos = c * SB + tl.arange(0, SB)
            cols = PEEL + cols_pos
            kk = tl.zeros([SB, SB], dtype=tl.float32)
            qk = tl.zeros([SB, SB], dtype=tl.float32)
            q_sq = tl.zeros([SB], dtype=tl.float32)
            kc_sq = tl.zeros([SB], dtype=tl.float32)
            for j in tl.static_range(BK // BKC):
                ck = j * BKC + tl.arange(0, BKC)
                b_kc = load_chunk(k, cols, ck, stride_kn, stride_kk, n_b, K)
                b_k = load_chunk(k, rows, ck, stride_kn, stride_kk, n_b, K)
                b_q = load_chunk(q, rows, ck, stride_qn, stride_qk, n_b, K)
                kk += dot_raw(b_k, tl.trans(b_kc), PREC, LOWP_QK)
                qk += dot_raw(b_q, tl.trans(b_kc), PREC, LOWP_QK)
                q_sq += tl.sum(b_q.to(tl.float32) * b_q.to(tl.float32), axis=1)
                kc_sq += tl.sum(b_kc.to(tl.float32) * b_kc.to(tl.float32), axis=1)
            rq = scale / tl.sqrt(q_sq + 1e-6) if USE_L2 else tl.full([SB], scale, dtype=tl.float32)
            rkc = 1.0 / tl.sqrt(kc_sq + 1e-6) if USE_L2 else tl.full([SB], 1.0, dtype=tl.float32)
            gc_hi, gc_lo = fp32_pair(path_sums(g, stride_gn, words, b * N, cols, n_b, W, BT))
            decay = masked_decay(ancestor_bits(words, b * N, rows, cols, W, n_b), gr_hi, gr_lo, gc_hi, gc_lo)
            at = pos[:, None] * NP + cols_pos[None, :]
            tl.store(solve + at, kk * (rk[:, None] * rkc[None, :]) * decay)
            tl.store(scores + at, qk * (rq[:, None] * rkc[None, :]) * decay)

        # The diagonal block: T_rr = (I + A_rr)^{-1} diag(beta_r), then P_rr.
        decay = masked_decay(ancestor_bits(words, b * N, rows, rows, W, n_b), gr_hi, gr_lo, gr_hi, gr_lo)
        kk = tl.zeros([SB, SB], dtype=tl.float32)
        for j in tl.static_range(BK // BKC):
            b_k = load_chunk(k, rows, j * BKC + tl.arange(0, BKC), stride_kn, stride_kk, n_b, K)
            kk += dot_raw(b_k, tl.trans(b_k), PREC, LOWP_QK)
        strict = rows[:, None] > rows[None, :]
        a = tl.where(strict, kk * (rk[:, None] * rk[None, :]) * decay * b_beta[:, None], 0.0)
        at = pos[:, None] * NP + pos[None, :]
        eye = tl.where(pos[:, None] == pos[None, :], 1.0, 0.0)
        tl.store(solve + at, block_forward_solve(a, eye, SB, BT, PREC) * b_beta[None, :])
        qk = tl.zeros([SB, SB], dtype=tl.float32)
        q_sq = tl.zeros([SB], dtype=tl.float32)
        for j in tl.static_range(BK // BKC):
            ck = j * BKC + tl.arange(0, BKC)
            b_k = load_chunk(k, rows, ck, stride_kn, stride_kk, n_b, K)
            b_q = load_chunk(q, rows, ck, stride_qn, stride_qk, n_b, K)
            qk += dot_raw(b_q, tl.trans(b_k), PREC, LOWP_QK)
            q_sq += tl.sum(b_q.to(tl.float32) * b_q.to(tl.float32), axis=1)
        rq = scale / tl.sqrt(q_sq + 1e-6) if USE_L2 else tl.full([SB], scale, dtype=tl.float32)
        tl.store(scores + at, qk * (rq[:, None] * rk[None, :]) * decay)


@triton.jit
def _verify_output_kernel(
    q, k, v, g, beta, state, slots, words, num_nodes,
    gate_sum, k_normed, solve, scores, o, delta,
    stride_qb, stride_qn, stride_qh, stride_qk,
    stride_kb, stride_kn, stride_kh, stride_kk,
    stride_vb, stride_vn, stride_vh, stride_vv,
    stride_gb, stride_gh, stride_bb, stride_bh,
    stride_ss, stride_sh, stride_sk, stride_sv,
    scale, N, HV, K, V, W,
    GROUP: tl.constexpr, NP: tl.constexpr, SB: tl.constexpr, PEEL: tl.constexpr, BK: tl.constexpr,
    BKC: tl.constexpr, BV: tl.constexpr, USE_L2: tl.constexpr, PREC: tl.constexpr,
    LOWP_QK: tl.constexpr, SPLIT_S0: tl.constexpr, NATIVE: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1)
    b = (i_bh // HV).to(tl.int64)
    hv = i_bh % HV
    h = hv // GROUP
    H = HV // GROUP
    n_b = tl.load(num_nodes + b)
    slot = tl.load(slots + b).to(tl.int64)
    cv = i_v * BV + tl.arange(0, BV)
    q += b * stride_qb + h * stride_qh
    k += b * stride_kb + h * stride_kh
    v += b * stride_vb + hv * stride_vh
    g += b * stride_gb + hv * stride_gh
    beta += b * stride_bb + hv * stride_bh
    state += slot * stride_ss + hv * stride_sh
    gate_sum += b * N * HV + hv
    k_normed += b * N * H * K + h * K
    solve += i_bh.to(tl.int64) * NP * NP
    scores += i_bh.to(tl.int64) * NP * NP
    out = b * N * HV * V + hv * V
    o += out
    delta += out

    # PEEL: node 0 as one recurrent step (G_0 and its normalised key stored here, not by
    # the prepare kernel); the workspace's rows are nodes 1 .. N - 1, which add its column.
    d0, rk0, g0 = None, None, None
    if PEEL:
        d0, rk0, g0 = tile_root_row(
            q, k, v, g, beta, state, o, delta, gate_sum, k_normed,
            stride_qk, stride_kk, stride_vv, stride_sk, stride_sv, scale, cv,
            (i_v == 0) & (hv % GROUP == 0), K, V, BK, BKC, BV, USE_L2,
        )
    for r in range(0, tl.cdiv(n_b - PEEL, SB)):
        pos = r * SB + tl.arange(0, SB)
        rows = PEEL + pos
        if PEEL:  # before the state products, while few tiles are alive (tile_row_block's spills)
            k_k0, q_k0 = root_products(q, k, stride_qn, stride_qk, stride_kn, stride_kk, rows, n_b, K, BK, BKC,
                                       PREC, LOWP_QK)
        ks = tl.zeros([SB, BV], dtype=tl.float32)
        qs = tl.zeros([SB, BV], dtype=tl.float32)
        k_sq = tl.zeros([SB], dtype=tl.float32)
        q_sq = tl.zeros([SB], dtype=tl.float32)
        for j in tl.static_range(BK // BKC):
            ck = j * BKC + tl.arange(0, BKC)
            s0 = load_rows(state, ck, cv, stride_sk, stride_sv, K, V)
            b_k = load_chunk(k, rows, ck, stride_kn, stride_kk, n_b, K)
            b_q = load_chunk(q, rows, ck, stride_qn, stride_qk, n_b, K)
            s_hi, s_mid, s_lo = bf16_parts(s0, SPLIT_S0)
            ks = dot_parts(b_k, s_hi, s_mid, s_lo, ks, PREC, SPLIT_S0, NATIVE, False)
            qs = dot_parts(b_q, s_hi, s_mid, s_lo, qs, PREC, SPLIT_S0, NATIVE, False)
            k_sq += tl.sum(b_k.to(tl.float32) * b_k.to(tl.float32), axis=1)
            q_sq += tl.sum(b_q.to(tl.float32) * b_q.to(tl.float32), axis=1)
        rk = 1.0 / tl.sqrt(k_sq + 1e-6) if USE_L2 else tl.full([SB], 1.0, dtype=tl.float32)
        rq = scale / tl.sqrt(q_sq + 1e-6) if USE_L2 else tl.full([SB], scale, dtype=tl.float32)
        gr_hi, gr_lo = fp32_pair(tl.load(gate_sum + rows * HV, mask=rows < n_b, other=0.0))
        e_g = tl.exp(gr_hi)
        u = load_rows(v, rows, cv, stride_vn, stride_vv, n_b, V) - (e_g * rk)[:, None] * ks
        b_o = (e_g * rq)[:, None] * qs
        if PEEL:  # u is V - e^G K S0 before beta (the workspace's T_rr applies it)
            u, b_o = add_root_column(u, b_o, d0, rk * rk0 * k_k0, rq * rk0 * q_k0, g0,
                                     words, b * N, rows, W, n_b, gr_hi, gr_lo)
        for c in range(0, r):
            cols_pos = c * SB + tl.arange(0, SB)
            cols = PEEL + cols_pos
            at = pos[:, None] * NP + cols_pos[None, :]
            d_c = load_rows(delta, cols, cv, HV * V, 1, N, V)
            u -= tl.dot(tl.load(solve + at), d_c, input_precision=PREC)
            b_o += tl.dot(tl.load(scores + at), d_c, input_precision=PREC)
        at = pos[:, None] * NP + pos[None, :]
        d = tl.dot(tl.load(solve + at), u, input_precision=PREC)
        b_o += tl.dot(tl.load(scores + at), d, input_precision=PREC)
        out_mask = (rows[:, None] < N) & (cv[None, :] < V)
        tl.store(delta + rows[:, None] * HV * V + cv[None, :], d, mask=out_mask)
        tl.store(o + rows[:, None] * HV * V + cv[None, :], b_o.to(o.dtype.element_ty), mask=out_mask)
        # Later blocks re-read this block's Delta, written by other threads.
        tl.debug_barrier()

    # Row blocks past the last real node: zeros, as documented for padding.
    zeros = tl.zeros([SB, BV], dtype=tl.float32)
    for r in range(tl.cdiv(n_b - PEEL, SB), tl.cdiv(N - PEEL, SB)):
        rows = PEEL + r * SB + tl.arange(0, SB)
        out_mask = (rows[:, None] < N) & (cv[None, :] < V)
        tl.store(delta + rows[:, None] * HV * V + cv[None, :], zeros, mask=out_mask)
        tl.store(o + rows[:, None] * HV * V + cv[None, :], zeros.to(o.dtype.element_ty), mask=out_mask)


@triton.jit
def _commit_kernel(
    state, slots, leaves, words, delta, gate_sum, k_normed, offsets,
    stride_ss, stride_sh, stride_sk, stride_sv,
    N, HV, K, V, W,
    GROUP: tl.constexpr, NP: tl.constexpr, PEEL: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    PREC: tl.constexpr, LAYERS: tl.constexpr, ALIGNED: tl.constexpr,
):
    # PEEL: node 0's term is an outer product of its own and the tile covers nodes
    # 1 .. N - 1, NP = dot_block(N - 1) rows (65 nodes: 64 rows instead of 128).
    # LAYERS: axis 0 also runs over layers, each reached by its row of ``offsets``
    # (chunk.gdn_tree_commit_layers: elements from layer 0's tensors, in argument order).
    i_v = tl.program_id(0)
    if LAYERS:
        v_blocks = tl.cdiv(V, BV)
        row = offsets + (i_v // v_blocks) * 5
        i_v = i_v % v_blocks
        state = layer_tensor(state, row, 0, ALIGNED)
        slots = layer_tensor(slots, row, 1, ALIGNED)
        delta = layer_tensor(delta, row, 2, ALIGNED)
        gate_sum = layer_tensor(gate_sum, row, 3, ALIGNED)
        k_normed = layer_tensor(k_normed, row, 4, ALIGNED)
    i_k = tl.program_id(1)
    i_bh = tl.program_id(2)
    b = (i_bh // HV).to(tl.int64)
    hv = i_bh % HV
    h = hv // GROUP
    H = HV // GROUP
    leaf = tl.load(leaves + b)
    slot = tl.load(slots + b).to(tl.int64)
    ck = i_k * BK + tl.arange(0, BK)
    cv = i_v * BV + tl.arange(0, BV)
    # The state tile is loaded before the path is known: the two loads overlap.
    ptr = state + slot * stride_ss + hv * stride_sh + ck[:, None] * stride_sk + cv[None, :] * stride_sv
    tile = (ck[:, None] < K) & (cv[None, :] < V)
    b_s = tl.load(ptr, mask=tile, other=0.0).to(tl.float32)
    # Nothing accepted: no path and no store, the slot stays bit-identical.
    n_path = tl.where(leaf >= 0, N, 0)
    k_store = tl.where(leaf >= 0, K, 0)
    leaf = tl.maximum(leaf, 0)
    leaf_words = words + (b * N + leaf) * W
    nodes = PEEL + tl.arange(0, NP)
    on_path = bit_is_set(tl.load(leaf_words + nodes // 64, mask=nodes < n_path, other=0), nodes)
    gate_sum += b * N * HV + hv
    g_leaf = tl.load(gate_sum + leaf * HV)
    b_g = tl.load(gate_sum + nodes * HV, mask=on_path, other=0.0)
    weight = tl.exp(tl.where(on_path, (g_leaf - b_g).to(tl.float32), float("-inf")))
    k_normed += b * N * H * K + h * K
    delta += b * N * HV * V + hv * V
    b_k = tl.load(k_normed + nodes[:, None] * H * K + ck[None, :],
                  mask=on_path[:, None] & (ck[None, :] < K), other=0.0)
    b_d = tl.load(delta + nodes[:, None] * HV * V + cv[None, :],
                  mask=on_path[:, None] & (cv[None, :] < V), other=0.0)
    b_s = b_s * tl.exp(g_leaf.to(tl.float32))
    b_s += tl.dot(tl.trans(b_k * weight[:, None]), b_d, input_precision=PREC)
    if PEEL:
        root_on_path = bit_is_set(tl.load(leaf_words), 0) & (n_path > 0)
        root_weight = tl.where(root_on_path, tl.exp((g_leaf - tl.load(gate_sum)).to(tl.float32)), 0.0)
        k_root = tl.load(k_normed + ck, mask=ck < K, other=0.0)
        d_root = tl.load(delta + cv, mask=cv < V, other=0.0)
        b_s += (k_root * root_weight)[:, None] * d_root[None, :]
    tl.store(ptr, b_s.to(ptr.dtype.element_ty), mask=tile & (ck[:, None] < k_store))


def key_chunk(K: int, k_chunk: int | None = None) -> int:
    """The K chunk the verify kernels run for head dim K when asked for ``k_chunk`` (a power
    of two from 16; None: K_CHUNK): at most the padded K."""
    if k_chunk is not None and (k_chunk < 16 or k_chunk & (k_chunk - 1)):
        raise ValueError(f"k_chunk must be a power of two >= 16, got {k_chunk}")
    return min(dot_block(K), k_chunk or K_CHUNK)


def check_warps(kernel: str, num_warps: int) -> None:
    if not kernel_takes_warps(kernel, num_warps):
        raise ValueError(f"num_warps: kernel {kernel!r} takes at most {PEELED_MAX_WARPS} warps (Triton 3.6 "
                         f"reads shared memory out of bounds at more), got {num_warps}")


def verify_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_state: torch.Tensor,
    state_slots: torch.Tensor,
    meta: TreeMetadata,
    scale: float,
    use_qk_l2norm: bool,
    precision: str,
    block_v: int | None = None,
    num_warps: int | None = None,
    prepare_warps: int | None = None,
    kernel: str | None = None,
    o: torch.Tensor | None = None,
    k_chunk: int | None = None,
    fuse_parts: bool = FUSE_STATE_PARTS,
    allocate: Allocate = new_tensor,
) -> GDNTreeVerifyOutput:
    """Launch the verify kernel ``kernel`` (one of ``VERIFY_KERNELS``; by default
    ``default_verify_kernel(N, B * HV)``); ``block_v``, ``num_warps`` (of the tile or
    output kernel), ``prepare_warps``, ``k_chunk`` (a power of two from 16, default
    K_CHUNK) and ``fuse_parts`` (:data:`FUSE_STATE_PARTS`, at 4 warps only: :func:`fuses_parts`)
    are tuning knobs for benchmarks.
    ``o``: a contiguous [B, N, HV, V] tensor the outputs go to (checked by
    ``gdn_tree_verify``), else a new one; ``allocate``: of the fields the commit reads."""
    B, N, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    BK = dot_block(K)
    BKC = key_chunk(K, k_chunk)
    words = meta.ancestor_words.contiguous()
    dev = q.device
    o = torch.empty(B, N, HV, V, dtype=v.dtype, device=dev) if o is None else o
    delta, gate_sum, k_normed = commit_fields(q, v, allocate).values()
    # The interpreter's bf16 is unreliable (triton#11584; its 16-bit tl.dot gave inf
    # here): fp32 operands give the same exact products.
    native = not interpreting()
    lowp = q.element_size() == 2 and native
    split_s0 = q.dtype == torch.bfloat16 and precision != "tf32"
    kernel = kernel or default_verify_kernel(N, B * HV)
    if kernel not in VERIFY_KERNELS or not kernel_takes(kernel, N):
        raise ValueError(f"kernel must be one of {VERIFY_KERNELS} (the tile kernels only for N <= "
                         f"{TILE_MAX_NODES}), got {kernel!r} at N = {N}")
    peel = int(kernel in PEELED_KERNELS)
    if kernel in TILE_KERNELS:
        first_rows, second_rows = tile_blocks(N - peel)
        BV, warps = default_tile_config(B * HV, V)
        BV = max(MIN_BLOCK_V, block_v or BV)
        warps = num_warps or warps
        check_warps(kernel, warps)
        _verify_tile_kernel[(triton.cdiv(V, BV), B * HV)](
            q, k, v, g, beta, ssm_state, state_slots, words, meta.num_nodes,
            o, delta, gate_sum, k_normed,
            *q.stride(), *k.stride(), *v.stride(), *g.stride(), *beta.stride(), *ssm_state.stride(),
            scale, N, HV, K, V, words.shape[-1],
            GROUP=HV // H, SB=first_rows, SB2=second_rows, PEEL=peel, CB=CROSS_COLS, BT=ROW_BLOCK, BK=BK,
            BKC=BKC, BV=BV,
            USE_L2=use_qk_l2norm, PREC=precision, LOWP_QK=lowp, SPLIT_S0=split_s0, NATIVE=native,
            FUSE_PARTS=fuses_parts(fuse_parts, warps), num_warps=warps,
        )
        return GDNTreeVerifyOutput(o=o, delta=delta, gate_sum=gate_sum, k_normed=k_normed)
    BV, warps = default_output_config(B * HV, V)
    BV = max(MIN_BLOCK_V, block_v or BV)
    warps = num_warps or warps
    check_warps(kernel, warps)
    # Workspace: only the blocks a request's own rows need are written and read.
    NP = dot_block(N - peel)
    solve = torch.empty(B * HV, NP, NP, dtype=torch.float32, device=dev)
    scores = torch.empty(B * HV, NP, NP, dtype=torch.float32, device=dev)
    SB = min(NP, MAX_SUPER_BLOCK)
    common = dict(GROUP=HV // H, NP=NP, SB=SB, PEEL=peel, BK=BK, BKC=BKC, USE_L2=use_qk_l2norm,
                  PREC=precision, LOWP_QK=lowp)
    _verify_prepare_kernel[(NP // SB, B * HV)](
        q, k, g, beta, words, meta.num_nodes,
        gate_sum, k_normed, solve, scores,
        *q.stride(), *k.stride(), *g.stride(), *beta.stride(),
        scale, N, HV, K, words.shape[-1],
        BT=ROW_BLOCK, num_warps=prepare_warps or 4, **common,
    )
    _verify_output_kernel[(triton.cdiv(V, BV), B * HV)](
        q, k, v, g, beta, ssm_state, state_slots, words, meta.num_nodes,
        gate_sum, k_normed, solve, scores, o, delta,
        *q.stride(), *k.stride(), *v.stride(), g.stride(0), g.stride(2), beta.stride(0), beta.stride(2),
        *ssm_state.stride(),
        scale, N, HV, K, V, words.shape[-1],
        BV=BV, SPLIT_S0=split_s0, NATIVE=native, num_warps=warps, **common,
    )
    return GDNTreeVerifyOutput(o=o, delta=delta, gate_sum=gate_sum, k_normed=k_normed)


def commit_triton(
    ssm_state: torch.Tensor,
    state_slots: torch.Tensor,
    meta: TreeMetadata,
    out: GDNTreeVerifyOutput,
    accepted_leaf: torch.Tensor,
    precision: str,
    block_k: int | None = None,
    block_v: int | None = None,
    num_warps: int = 4,
    layers: tuple[torch.Tensor, bool] | None = None,
) -> None:
    """Launch the commit kernel; ``block_k``, ``block_v`` (powers of two from 16: the state
    tile a program updates, at most 64 each by default) and ``num_warps`` are tuning knobs
    for benchmarks. With ``layers`` (the [L, 5] table and alignment of
    :func:`triton_ops.utils.layer_offsets`, made by :func:`.chunk.gdn_tree_commit_layers`)
    the launch commits L layers, the arguments being layer 0's."""
    B, N, HV, V = out.delta.shape
    H, K = out.k_normed.shape[2], out.k_normed.shape[3]
    # Node 0 apart where that shrinks the node tile (the engine's 1 + 2^k nodes).
    peel = int(peel_shrinks_split(N))
    BK = block_k or min(dot_block(K), 64)
    BV = block_v or min(dot_block(V), 64)
    words = meta.ancestor_words.contiguous()
    # One launch for every layer: ~48 latency-bound launches of ~11 us at batch 1 become
    # one whose programs fill the GPU. Without layers, ``offsets`` is never read.
    offsets, aligned = (accepted_leaf, False) if layers is None else layers
    num_layers = 1 if layers is None else offsets.shape[0]
    _commit_kernel[(num_layers * triton.cdiv(V, BV), triton.cdiv(K, BK), B * HV)](
        ssm_state, state_slots, accepted_leaf, words, out.delta, out.gate_sum, out.k_normed,
        offsets, *ssm_state.stride(), N, HV, K, V, words.shape[-1],
        GROUP=HV // H, NP=dot_block(N - peel), PEEL=peel, BK=BK, BV=BV, PREC=precision,
        LAYERS=layers is not None, ALIGNED=aligned, num_warps=num_warps,
    )
