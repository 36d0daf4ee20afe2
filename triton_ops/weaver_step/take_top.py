"""The top ``count`` entries of each row, ties to the lower column.

This is the order of a stable descending sort, so the best-first builders pop
their frontier (column = insertion order) and rank a node's children (column =
pool index) with it. ``consume`` sets the taken entries to -inf in place: the
frontier pop. The Triton form runs one program per row and takes one entry per
iteration (count is at most 32 frontier pops or a fan-out of a few children),
so no sort of the whole row is needed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton_ops.utils import use_triton


def take_top(
    values: torch.Tensor,
    count: int,
    *,
    consume: bool = False,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``count`` largest entries of each row of ``values`` [..., C] float32.

    Returns (top [..., count] float32, columns [..., count] int64) in descending
    order, equal values in ascending column order (-inf entries too; NaN ranks
    first on the torch path and as -inf on the Triton path). With
    ``consume`` (``values`` contiguous), the taken entries become -inf in place.
    """
    triton_path = use_triton(backend, values)
    if values.dtype != torch.float32 or values.dim() < 1:
        raise ValueError(f"values must be a float32 [..., C] tensor, got {values.dtype} "
                         f"{list(values.shape)}")
    width = values.shape[-1]
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= width:
        raise ValueError(f"count must be an int in [1, C={width}], got {count!r}")
    if consume and not values.is_contiguous():
        raise ValueError("consume=True needs contiguous values (they are written in place)")
    if not triton_path:
        top, columns = torch.sort(values, dim=-1, descending=True, stable=True)
        top, columns = top[..., :count], columns[..., :count]
        if consume:
            values.scatter_(-1, columns, float("-inf"))
        return top, columns
    rows = values.reshape(-1, width) if consume else values.reshape(-1, width).contiguous()
    top = torch.empty(rows.shape[0], count, dtype=torch.float32, device=values.device)
    columns = torch.empty(rows.shape[0], count, dtype=torch.int64, device=values.device)
    if rows.shape[0]:
        _take_top_kernel[(rows.shape[0],)](
            rows, top, columns, width, rows.stride(0), COUNT=count, CONSUME=consume,
            BLOCK=triton.next_power_of_2(width),
        )
    shape = (*values.shape[:-1], count)
    return top.view(shape), columns.view(shape)


@triton.jit
def _take_top_kernel(values_ptr, top_ptr, columns_ptr, WIDTH, stride,
                     COUNT: tl.constexpr, CONSUME: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    inside = offs < WIDTH
    values = tl.load(values_ptr + row * stride + offs, mask=inside, other=-float("inf"))
    values = tl.where(values == values, values, -float("inf"))  # NaN never wins a place
    # Taken entries and the tile's tail are out of the race. -inf is a real value
    # (a padding entry), so "taken" is a mask of its own, not a sentinel value.
    free = inside
    for i in tl.static_range(COUNT):
        best = tl.max(tl.where(free, values, -float("inf")), axis=0)
        column = tl.min(tl.where(free & (values == best), offs, BLOCK), axis=0)
        tl.store(top_ptr + row * COUNT + i, best)
        tl.store(columns_ptr + row * COUNT + i, column.to(tl.int64))
        free = free & (offs != column)
    if CONSUME:
        taken = inside & ~free
        tl.store(values_ptr + row * stride + offs, tl.full((BLOCK,), -float("inf"), tl.float32),
                 mask=taken)
