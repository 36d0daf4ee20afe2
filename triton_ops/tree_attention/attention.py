"""Tree attention over a paged KV cache: every draft-tree node attends to the
committed prefix and to its own ancestors (itself included), never to siblings.

The tree nodes' K/V already sit in the paged cache at logical positions
``prefix_len + node`` (the engine writes them with the linear slot mapping);
node ``i`` is a query at token position ``prefix_len + depth(i)``.

CUDA runs two kernels (flash-decoding): a split kernel where each program
takes one block of query rows of one KV head (all query heads of a GQA group
together, so K/V are read once per group) and either one chunk of the prefix
or the tree keys under the ancestor mask; then a merge of the partial softmaxes.
The number of prefix chunks depends on shapes only and chunks shorter than a
minimum stay idle, so nothing waits on the host and the launch is graph-safe.
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
# (block_m, block_n, num_warps, num_stages) of the split kernel on CUDA: the fastest
# of the H200 sweep in tools/bench_kernels.py --sweep at D=256, B=1, N=64, prefix 32k
# (234 us; 64x32 tiles with 4 warps: 238 us; the first 64x64 tiles: 353 us).
CUDA_TILES = (128, 32, 8, 2)
MAX_SPLITS = 64


@dataclass(frozen=True)
class KernelConfig:
    """Tile sizes of the split kernel. ``min_chunk`` (a multiple of ``block_n``)
    is the fewest prefix keys a split takes, so short prefixes use few splits."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    min_chunk: int
    num_splits: int


@triton.jit
def _attend_key_block(
    q, m_i, l_i, acc, visible,
    k_ptr, v_ptr, k_rows, v_rows, key_ok, offs_d, d_mask, stride_kd, stride_vd,
    qk_scale, soft_cap,
    SOFT_CAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One online-softmax step over a block of keys, logits in log2 units.

    Without a soft cap ``qk_scale`` is scale * log2(e). With one it is
    scale * 2 log2(e) / cap and ``soft_cap`` is cap * log2(e), so that
    cap * tanh(x / cap) * log2(e) = soft_cap * (1 - 2 / (exp2(q.k * qk_scale) + 1)).
    """
    kv_mask = key_ok[:, None] & d_mask[None, :]
    k = tl.load(k_ptr + k_rows[:, None] + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)
    logits = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    if SOFT_CAP:
        logits = soft_cap - 2.0 * soft_cap / (tl.exp2(logits) + 1.0)
    logits = tl.where(visible, logits, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(logits, 1))
    # A row that has seen no visible key yet keeps m = -inf; shift it by 0 instead.
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(logits - m_shift[:, None])
    alpha = tl.exp2(m_i - m_shift)
    v = tl.load(v_ptr + v_rows[:, None] + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i * alpha + tl.sum(p, 1), acc


@triton.jit
def _tree_attention_split_kernel(
    q_ptr, k_ptr, v_ptr, block_table_ptr, prefix_ptr, num_nodes_ptr, depths_ptr, words_ptr,
    part_o_ptr, part_lse_ptr,
    Hkv, G, block_size, num_splits, qk_scale, soft_cap, window,
    stride_qb, stride_qn, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_tb, stride_tk,
    stride_db, stride_dn,
    stride_wb, stride_wn, stride_ww,
    stride_ob, stride_os, stride_on, stride_oh,
    stride_lb, stride_ls, stride_ln,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MIN_CHUNK: tl.constexpr, SOFT_CAP: tl.constexpr, SLIDING: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2) // Hkv
    h = tl.program_id(2) % Hkv
    prefix_len = tl.load(prefix_ptr + b).to(tl.int32)
    num_rows = tl.load(num_nodes_ptr + b) * G
    # Rows are node-major: row r is query head h*G + r % G of node r // G.
    if pid_m * BLOCK_M >= num_rows:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < num_rows
    node = rows // G
    head = h * G + rows % G
    b64 = b.to(tl.int64)
    lse_ptrs = part_lse_ptr + b64 * stride_lb + split * stride_ls + node * stride_ln + head

    is_tree = split == num_splits
    if is_tree:
        start = prefix_len * 0
        end = (tl.minimum(pid_m * BLOCK_M + BLOCK_M, num_rows) - 1) // G + 1
    else:
        low = prefix_len * 0
        if SLIDING:
            # The shallowest query (depth 0) sees keys from prefix_len - window + 1 on.
            low = tl.maximum(prefix_len - window + 1, 0)
        chunk = tl.maximum(tl.cdiv(tl.cdiv(prefix_len - low, num_splits), MIN_CHUNK), 1) * MIN_CHUNK
        start = low + split * chunk
        end = tl.minimum(start + chunk, prefix_len)
    if start >= end:
        # An idle split: the merge skips partials whose lse is -inf.
        tl.store(lse_ptrs, tl.full((BLOCK_M,), float("-inf"), tl.float32), mask=row_ok)
        return

    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q = tl.load(
        q_ptr + b64 * stride_qb + node[:, None] * stride_qn + head[:, None] * stride_qh
        + offs_d[None, :] * stride_qd,
        mask=row_ok[:, None] & d_mask[None, :], other=0.0,
    )
    q_depth = tl.load(depths_ptr + b * stride_db + node * stride_dn, mask=row_ok, other=0)
    table = block_table_ptr + b64 * stride_tb
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)

    if is_tree:
        for key_start in range(start, end, BLOCK_N):
            j = key_start + tl.arange(0, BLOCK_N)
            key_ok = j < end
            pos = prefix_len + j
            blk = tl.load(table + (pos // block_size) * stride_tk, mask=key_ok, other=0).to(tl.int64)
            words = tl.load(
                words_ptr + b64 * stride_wb + node[:, None] * stride_wn + (j // 64)[None, :] * stride_ww,
                mask=row_ok[:, None] & key_ok[None, :], other=0,
            )
            visible = bit_is_set(words, j[None, :])
            if SLIDING:
                k_depth = tl.load(depths_ptr + b * stride_db + j * stride_dn, mask=key_ok, other=0)
                visible = visible & ((q_depth[:, None] - k_depth[None, :]) < window)
            m_i, l_i, acc = _attend_key_block(
                q, m_i, l_i, acc, visible & key_ok[None, :],
                k_ptr, v_ptr,
                blk * stride_kb + (pos % block_size) * stride_kt + h * stride_kh,
                blk * stride_vb + (pos % block_size) * stride_vt + h * stride_vh,
                key_ok, offs_d, d_mask, stride_kd, stride_vd, qk_scale, soft_cap,
                SOFT_CAP, DOT_PRECISION,
            )
    else:
        for key_start in range(start, end, BLOCK_N):
            pos = key_start + tl.arange(0, BLOCK_N)
            key_ok = pos < end
            blk = tl.load(table + (pos // block_size) * stride_tk, mask=key_ok, other=0).to(tl.int64)
            visible = key_ok[None, :]
            if SLIDING:
                visible = visible & ((prefix_len + q_depth[:, None] - pos[None, :]) < window)
            m_i, l_i, acc = _attend_key_block(
                q, m_i, l_i, acc, visible,
                k_ptr, v_ptr,
                blk * stride_kb + (pos % block_size) * stride_kt + h * stride_kh,
                blk * stride_vb + (pos % block_size) * stride_vt + h * stride_vh,
                key_ok, offs_d, d_mask, stride_kd, stride_vd, qk_scale, soft_cap,
                SOFT_CAP, DOT_PRECISION,
            )

    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
    part = b64 * stride_ob + split * stride_os + node * stride_on + head * stride_oh
    tl.store(part_o_ptr + part[:, None] + offs_d[None, :], out, mask=row_ok[:, None] & d_mask[None, :])
    tl.store(lse_ptrs, lse, mask=row_ok)


@triton.jit
def _tree_attention_merge_kernel(
    part_o_ptr, part_lse_ptr, num_nodes_ptr, o_ptr,
    N, num_parts,
    stride_ob, stride_os, stride_on, stride_oh,
    stride_lb, stride_ls, stride_ln,
    stride_yb, stride_yn, stride_yh, stride_yd,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0) // N
    n = tl.program_id(0) % N
    head = tl.program_id(1)
    b64 = b.to(tl.int64)
    valid = n < tl.load(num_nodes_ptr + b)
    splits = tl.arange(0, BLOCK_S)
    # A padded node's partials were never written: read none (the bound is a
    # scalar so that the mask stays a vector compare, as the interpreter needs).
    lse = tl.load(part_lse_ptr + b64 * stride_lb + splits * stride_ls + n * stride_ln + head,
                  mask=splits < tl.where(valid, num_parts, 0), other=float("-inf"))
    # The tree split holds the node itself, so a valid node has a finite maximum
    # and a weight sum >= 1; the clamps only keep padded nodes free of NaN.
    weight = tl.exp2(lse - tl.maximum(tl.max(lse, 0), -1e30))
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    part = tl.load(
        part_o_ptr + b64 * stride_ob + splits[:, None] * stride_os + n * stride_on
        + head * stride_oh + offs_d[None, :],
        mask=(lse > float("-inf"))[:, None] & d_mask[None, :], other=0.0,
    )
    out = tl.sum(part * weight[:, None], 0) / tl.maximum(tl.sum(weight, 0), 1e-30)
    out = tl.where(valid, out, 0.0)
    tl.store(o_ptr + b64 * stride_yb + n * stride_yn + head * stride_yh + offs_d * stride_yd,
             out.to(o_ptr.dtype.element_ty), mask=d_mask)


def kernel_config(q: torch.Tensor, num_kv_heads: int) -> KernelConfig:
    """Tiles and split count for the split kernel on ``q``'s device."""
    B, N, Hq, D = q.shape
    rows = N * (Hq // num_kv_heads)
    if q.device.type != "cuda":
        # The interpreter: small tiles keep it fast, and three splits exercise the merge.
        block_m = min(32, dot_block(rows))
        return KernelConfig(block_m, 16, 4, 1, 16, 3)
    block_m, block_n, num_warps, num_stages = CUDA_TILES
    programs_per_split = B * num_kv_heads * triton.cdiv(rows, block_m)
    num_sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    num_splits = split_count(programs_per_split, num_sms)
    return KernelConfig(block_m, block_n, num_warps, num_stages, 4 * block_n, num_splits)


def split_count(programs_per_split: int, num_sms: int, max_splits: int = MAX_SPLITS) -> int:
    """Prefix splits that finish a long prefix soonest: with one program per SM at a
    time (the 128-row tiles fill an SM's registers), S splits of a prefix of L keys
    take ``ceil(P S / num_sms)`` waves of ``L / S`` keys each. The smallest S of the
    least cost wins (fewer partials to merge); short prefixes leave splits idle."""
    def cost(splits: int) -> float:
        return math.ceil(programs_per_split * splits / num_sms) / splits

    return min(range(1, max_splits + 1), key=lambda splits: (cost(splits), splits))


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
    """The two Triton launches with explicit tiles (the benchmark sweeps ``config``).

    Returns the split kernel's compiled handle (registers and spills for the benchmark).
    """
    check_untiled("key_cache", key_cache)
    check_untiled("value_cache", value_cache)
    B, N, Hq, D = q.shape
    Hkv = key_cache.shape[2]
    G = Hq // Hkv
    S = config.num_splits
    part_o = torch.empty(B, S + 1, N, Hq, D, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(B, S + 1, N, Hq, dtype=torch.float32, device=q.device)
    block_d = dot_block(D)
    window = sliding_window if sliding_window is not None else 0
    words = meta.ancestor_words
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    if logits_soft_cap is None:
        qk_scale, soft_cap = scale * LOG2E, 0.0
    else:
        qk_scale, soft_cap = scale * 2.0 * LOG2E / logits_soft_cap, logits_soft_cap * LOG2E
    grid = (triton.cdiv(N * G, config.block_m), S + 1, B * Hkv)
    split_kernel = _tree_attention_split_kernel[grid](
        q, key_cache, value_cache, block_table, prefix_lens, meta.num_nodes, meta.depths, words,
        part_o, part_lse,
        Hkv, G, key_cache.shape[1], S, qk_scale, soft_cap, window,
        *q.stride(), *key_cache.stride(), *value_cache.stride(), *block_table.stride(),
        *meta.depths.stride(), *words.stride(), *part_o.stride()[:4], *part_lse.stride()[:3],
        HEAD_DIM=D, BLOCK_D=block_d, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        MIN_CHUNK=config.min_chunk, SOFT_CAP=logits_soft_cap is not None,
        SLIDING=sliding_window is not None, DOT_PRECISION=precision,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    _tree_attention_merge_kernel[(B * N, Hq)](
        part_o, part_lse, meta.num_nodes, out,
        N, S + 1,
        *part_o.stride()[:4], *part_lse.stride()[:3], *out.stride(),
        HEAD_DIM=D, BLOCK_D=block_d, BLOCK_S=triton.next_power_of_2(S + 1),
        num_warps=4,
    )
    return split_kernel
