"""Log-probabilities over a candidate pool from gathered low-rank table rows.

For every query row ``y`` with pool ``ids`` and base logits ``scores``:

    l_k = scores_k + <table[ids_k], y>,      log q_k = l_k - logsumexp_k(l)

Only the P pooled rows of ``table`` are read, never the whole vocabulary. The
Triton form runs one program per (row, block of pool entries) to fill ``l``
(a gather-bound dot) and one program per row to normalise it in place. With
``pool_rows``, each query picks its pool from a per-request table of pools, so
the caller gathers nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton_ops.utils import check_same_device, output_buffer, use_triton

# The torch path gathers [rows, P, D] table entries at once; bounding the chunk
# keeps a 512-entry pool over a 2048-wide table from allocating gigabytes.
_TORCH_GATHER_BYTES = 64 << 20
# A program gathers its [BLOCK_P, BLOCK_D] rows in one load of at most TILE_ELEMENTS
# elements, the whole query width up to MAX_BLOCK_D, so that all of them are in flight at
# once. Stepping over D 128 columns at a time, the published Weaver's call (4 queries x 512
# rows of 2048) took 13.7 us on the H200 (BENCHMARKS.md, "Draft rounds at the target's
# pace"), ~0.6 TB/s: 16 dependent loads of 4 KB per program.
MAX_BLOCK_D = 2048
TILE_ELEMENTS = 8192


def pool_logits_log_softmax(
    y: torch.Tensor,
    table: torch.Tensor,
    ids: torch.Tensor,
    scores: torch.Tensor,
    *,
    pool_rows: torch.Tensor | None = None,
    backend: str = "auto",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """log_softmax over the pool of ``scores + <table[ids], y>``.

    Args:
        y: [R, w, D] float queries (any float dtype; products accumulate in fp32).
        table: [V, D] float rows, e.g. ``W_q = W_lm @ lm_head_query_in.weight``.
        ids: [R, w, P] int64 indices into ``table``, each in [0, V).
        scores: [R, w, P] float base logits (raw target LM-head logits).
        pool_rows: optional [R, w] int64. Then ``ids`` and ``scores`` are [R, D, P]
            pools per request and query (r, j) scores row ``pool_rows[r, j]`` of
            them; -1 marks a query without a pool, whose output row is -inf.
        backend: "auto" (Triton for CUDA tensors, PyTorch otherwise), "torch",
            or "triton" (see :func:`triton_ops.utils.use_triton`).
        out: optional [R, w, P] float32 contiguous tensor to write into.

    Returns:
        [R, w, P] float32 log-probabilities; each row's exp sums to 1.
    """
    triton_path = use_triton(backend, ids)
    _check_inputs(y, table, ids, scores, pool_rows)
    rows, width = y.shape[:2]
    pool = ids.shape[2]
    shape = (rows, width, pool)
    out = output_buffer(out, shape, torch.float32, y.device, "[R, w, P]")
    # Both paths write through flat [R * w, P] views of out.
    if not out.is_contiguous():
        raise ValueError(f"out must be contiguous, got strides {out.stride()}")
    if rows * width == 0:
        return out
    if triton_path:
        _triton_pool_log_softmax(y, table, ids, scores, pool_rows, out)
        return out
    if pool_rows is not None:
        batch = torch.arange(rows, device=ids.device)[:, None]
        picked = pool_rows.clamp(min=0)
        ids, scores = ids[batch, picked], scores[batch, picked]
    _torch_pool_log_softmax(
        y.reshape(rows * width, y.shape[-1]), table, ids.reshape(rows * width, pool),
        scores.reshape(rows * width, pool), out.view(rows * width, pool),
    )
    if pool_rows is not None:
        out.masked_fill_((pool_rows < 0)[..., None], float("-inf"))
    return out


def _check_inputs(y, table, ids, scores, pool_rows) -> None:
    if y.dim() != 3:
        raise ValueError(f"y must be [R, w, D], got shape {list(y.shape)}")
    if table.dim() != 2:
        raise ValueError(f"table must be [V, D], got shape {list(table.shape)}")
    if ids.dim() != 3 or ids.dtype != torch.int64:
        raise ValueError(
            f"ids must be an int64 [R, w, P] tensor, got {ids.dtype} {list(ids.shape)}"
        )
    if pool_rows is not None:
        if pool_rows.shape != y.shape[:2] or pool_rows.dtype != torch.int64:
            raise ValueError(f"pool_rows must be int64 [R, w] = {list(y.shape[:2])}, got "
                             f"{pool_rows.dtype} {list(pool_rows.shape)}")
        if ids.shape[0] != y.shape[0] or ids.shape[1] < 1:
            raise ValueError(f"with pool_rows, ids must be [R={y.shape[0]}, D >= 1, P], got "
                             f"{list(ids.shape)}")
    elif ids.shape[:2] != y.shape[:2]:
        raise ValueError(
            f"ids [R, w, P] must match y [R, w, D] in R and w: "
            f"ids {list(ids.shape)}, y {list(y.shape)}"
        )
    if ids.shape[2] < 1:
        raise ValueError("ids must hold at least one pool entry (P >= 1)")
    if scores.shape != ids.shape:
        raise ValueError(
            f"scores must have the shape of ids {list(ids.shape)}, got {list(scores.shape)}"
        )
    if table.shape[1] != y.shape[2]:
        raise ValueError(
            f"table width {table.shape[1]} must equal the query width D = {y.shape[2]}"
        )
    for name, t in (("y", y), ("table", table), ("scores", scores)):
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a float tensor, got {t.dtype}")
    check_same_device("y", y, table=table, ids=ids, scores=scores)


def _torch_pool_log_softmax(y, table, ids, scores, out) -> None:
    n, pool = ids.shape
    vocab, width = table.shape
    if vocab <= n * pool:
        # A small vocabulary (the tiny family's 1024) costs less as one dense
        # product than as n * P gathered rows.
        residual = (y.float() @ table.float().T).gather(1, ids)
        out.copy_(torch.log_softmax(scores.float() + residual, dim=-1))
        return
    chunk = max(1, _TORCH_GATHER_BYTES // (pool * width * 4))
    for start in range(0, n, chunk):
        stop = min(start + chunk, n)
        gathered = table[ids[start:stop]].float()  # [n, P, D]
        residual = torch.bmm(gathered, y[start:stop].float().unsqueeze(-1)).squeeze(-1)
        out[start:stop] = torch.log_softmax(scores[start:stop].float() + residual, dim=-1)


@triton.jit
def _pool_logits_kernel(
    y_ptr,
    table_ptr,
    ids_ptr,
    scores_ptr,
    rows_ptr,
    out_ptr,
    POOL,
    WIDTH,
    QUERIES,
    DEPTH,
    stride_y,
    stride_table,
    stride_ids,
    stride_scores,
    stride_out,
    PICK_ROWS: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs_p = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    mask_p = offs_p < POOL
    pool_row = row
    has_pool = True
    if PICK_ROWS:
        picked = tl.load(rows_ptr + row)
        has_pool = picked >= 0
        pool_row = (row // QUERIES) * DEPTH + tl.maximum(picked, 0)
    ids = tl.load(ids_ptr + pool_row * stride_ids + offs_p, mask=mask_p, other=0)
    row_ptrs = table_ptr + ids[:, None] * stride_table
    acc = tl.zeros((BLOCK_P,), dtype=tl.float32)
    for d0 in range(0, WIDTH, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        mask_d = offs_d < WIDTH
        query = tl.load(y_ptr + row * stride_y + offs_d, mask=mask_d, other=0.0)
        rows = tl.load(
            row_ptrs + offs_d[None, :], mask=mask_p[:, None] & mask_d[None, :], other=0.0
        )
        acc += tl.sum(rows.to(tl.float32) * query.to(tl.float32)[None, :], axis=1)
    base = tl.load(scores_ptr + pool_row * stride_scores + offs_p, mask=mask_p, other=0.0)
    logits = tl.where(has_pool, base.to(tl.float32) + acc, -float("inf"))
    tl.store(out_ptr + row * stride_out + offs_p, logits, mask=mask_p)


@triton.jit
def _log_softmax_rows_kernel(out_ptr, POOL, stride_out, BLOCK_P: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = out_ptr + row * stride_out
    # Online logsumexp; a tile of only -inf must not turn the running sum into NaN.
    run_max = tl.full((), -float("inf"), dtype=tl.float32)
    run_sum = tl.zeros((), dtype=tl.float32)
    for p0 in range(0, POOL, BLOCK_P):
        offs = p0 + tl.arange(0, BLOCK_P)
        logits = tl.load(base + offs, mask=offs < POOL, other=-float("inf"))
        new_max = tl.maximum(run_max, tl.max(logits, axis=0))
        shift = tl.where(new_max == -float("inf"), 0.0, new_max)
        run_sum = run_sum * tl.exp(run_max - shift) + tl.sum(tl.exp(logits - shift), axis=0)
        run_max = new_max
    # run_sum >= 1 once a finite logit was seen (the max adds exp(0)); a row of only
    # -inf (a query without a pool) gets lse 0 and stays -inf, not NaN.
    empty = run_max == -float("inf")
    lse = tl.where(empty, 0.0, run_max + tl.log(tl.maximum(run_sum, 1.0)))
    for p0 in range(0, POOL, BLOCK_P):
        offs = p0 + tl.arange(0, BLOCK_P)
        mask = offs < POOL
        logits = tl.load(base + offs, mask=mask, other=0.0)
        tl.store(base + offs, logits - lse, mask=mask)


def _triton_pool_log_softmax(y, table, ids, scores, pool_rows, out) -> None:
    rows, queries, width = y.shape
    n, depth, pool = rows * queries, ids.shape[1], ids.shape[2]
    y = y.reshape(n, width).contiguous()
    table = table.contiguous()
    ids = ids.reshape(-1, pool).contiguous()
    scores = scores.reshape(-1, pool).contiguous()
    out = out.view(n, pool)
    # Enough programs to keep the SMs busy when few queries read a 512-entry pool.
    spread = max(16, triton.next_power_of_2(max(1, n * pool // 512)))
    block_d = min(MAX_BLOCK_D, triton.next_power_of_2(width))
    block_p = min(64, triton.next_power_of_2(pool), spread, max(1, TILE_ELEMENTS // block_d))
    picks = pool_rows is not None
    _pool_logits_kernel[(n, triton.cdiv(pool, block_p))](
        y,
        table,
        ids,
        scores,
        pool_rows.contiguous() if picks else ids,
        out,
        pool,
        width,
        queries,
        depth,
        y.stride(0),
        table.stride(0),
        ids.stride(0),
        scores.stride(0),
        out.stride(0),
        PICK_ROWS=picks,
        BLOCK_P=block_p,
        BLOCK_D=block_d,
    )
    _log_softmax_rows_kernel[(n,)](
        out, pool, out.stride(0), BLOCK_P=min(1024, triton.next_power_of_2(pool))
    )
