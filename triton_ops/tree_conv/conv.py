"""Tree-aware depthwise causal conv1d (the conv that precedes GDN) and its commit.

In a chain, tap ``t`` of token ``i`` reads token ``i - t``. In a draft tree it
reads the node's ``t``-th ancestor, and past the root the committed conv state
(see ``TreeMetadata.conv_sources``). Each node is a gather of W rows plus W
FMAs per channel; nothing speculative is written to the conv state until
:func:`tree_conv1d_commit` appends the accepted path.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from triton_ops.tree_metadata import TreeMetadata, check_accepted_leaf, check_node_tensor
from triton_ops.utils import (
    FLOAT_DTYPES,
    check_index_vector,
    check_same_device,
    host_readable,
    layer_offsets,
    layer_tensor,
    output_buffer,
    use_triton,
)

ACTIVATIONS = ("silu", None)
# (block_n, block_c, num_warps) of the conv kernel; tools/bench_kernels.py --sweep sweeps them.
CUDA_TILES = (16, 256, 4)


@triton.jit
def _tree_conv1d_kernel(
    x_ptr, weight_ptr, bias_ptr, state_ptr, slots_ptr, sources_ptr, num_nodes_ptr, y_ptr, copy_ptr,
    N, C,
    stride_xb, stride_xn, stride_xc,
    stride_wc, stride_wt,
    stride_ss, stride_sc, stride_st,
    stride_qb, stride_qn, stride_qt,
    stride_yb, stride_yn, stride_yc,
    stride_cb, stride_cn, stride_cc,
    W: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, COPY_X: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
):
    pid_c = tl.program_id(0)
    pid_n = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = offs_c < C
    valid = offs_n < tl.load(num_nodes_ptr + b)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    # A slot < 0 (vLLM's padding slot) has no committed state: no state column is
    # readable and those taps read zeros.
    lowest_source = tl.where(slot >= 0, 1 - W, 0)

    acc = tl.zeros((BLOCK_N, BLOCK_C), dtype=tl.float32)
    for t in tl.static_range(W):
        src = tl.load(
            sources_ptr + b * stride_qb + offs_n * stride_qn + t * stride_qt, mask=valid, other=0
        )
        from_x = (valid & (src >= 0))[:, None] & c_mask[None, :]
        from_state = (valid & (src < 0) & (src >= lowest_source))[:, None] & c_mask[None, :]
        x_val = tl.load(
            x_ptr + b * stride_xb + src[:, None] * stride_xn + offs_c[None, :] * stride_xc,
            mask=from_x, other=0.0,
        )
        s_val = tl.load(
            state_ptr + slot * stride_ss + offs_c[None, :] * stride_sc
            + (W - 1 + src)[:, None] * stride_st,
            mask=from_state, other=0.0,
        )
        tap_weight = tl.load(
            weight_ptr + offs_c * stride_wc + (W - 1 - t) * stride_wt, mask=c_mask, other=0.0
        )
        acc += (x_val.to(tl.float32) + s_val.to(tl.float32)) * tap_weight.to(tl.float32)[None, :]
        if COPY_X and t == 0:  # tap 0 is each node's own input
            tl.store(copy_ptr + b * stride_cb + offs_n[:, None] * stride_cn + offs_c[None, :] * stride_cc,
                     x_val, mask=valid[:, None] & c_mask[None, :])
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_c, mask=c_mask, other=0.0).to(tl.float32)[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    acc = tl.where(valid[:, None], acc, 0.0)
    tl.store(
        y_ptr + b * stride_yb + offs_n[:, None] * stride_yn + offs_c[None, :] * stride_yc,
        acc.to(y_ptr.dtype.element_ty),
        mask=(offs_n < N)[:, None] & c_mask[None, :],
    )


@triton.jit
def _tree_conv1d_commit_kernel(
    state_ptr, slots_ptr, x_ptr, sources_ptr, leaf_ptr, offsets_ptr,
    C,
    stride_ss, stride_sc, stride_st,
    stride_xb, stride_xn, stride_xc,
    stride_qb, stride_qn, stride_qt,
    W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, LAYERS: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    pid_c = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    if LAYERS:  # axis 2: the layer, reached by its row of tree_conv1d_commit_layers' table
        row = offsets_ptr + tl.program_id(2) * 3
        state_ptr = layer_tensor(state_ptr, row, 0, ALIGNED)
        slots_ptr = layer_tensor(slots_ptr, row, 1, ALIGNED)
        x_ptr = layer_tensor(x_ptr, row, 2, ALIGNED)
    leaf = tl.load(leaf_ptr + b).to(tl.int64)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    if (leaf >= 0) & (slot >= 0):
        offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
        col = tl.arange(0, BLOCK_T)
        col_mask = col < W - 1
        # New column ``col`` (oldest to newest) is tap W-2-col of the leaf.
        src = tl.load(
            sources_ptr + b * stride_qb + leaf * stride_qn + (W - 2 - col) * stride_qt,
            mask=col_mask, other=0,
        )
        c_mask = offs_c < C
        from_x = c_mask[:, None] & (col_mask & (src >= 0))[None, :]
        from_state = c_mask[:, None] & (col_mask & (src < 0))[None, :]
        x_val = tl.load(
            x_ptr + b * stride_xb + src[None, :] * stride_xn + offs_c[:, None] * stride_xc,
            mask=from_x, other=0.0,
        )
        state_row = state_ptr + slot * stride_ss + offs_c[:, None] * stride_sc
        s_val = tl.load(state_row + (W - 1 + src)[None, :] * stride_st, mask=from_state, other=0.0)
        new_val = tl.where(from_x, x_val.to(state_ptr.dtype.element_ty), s_val)
        # In place: every thread must have read the old columns before any is overwritten.
        tl.debug_barrier()
        tl.store(state_row + col[None, :] * stride_st, new_val, mask=c_mask[:, None] & col_mask[None, :])


def _check_common(
    x: torch.Tensor, conv_state: torch.Tensor, state_slots: torch.Tensor, meta: TreeMetadata
) -> tuple[int, int, int, int]:
    check_node_tensor(meta, "x", x, ("C",))
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"x must be one of {FLOAT_DTYPES}, got {x.dtype}")
    B, N, C = x.shape
    W = meta.conv_width
    if W < 2:
        raise ValueError(f"meta must be built with conv_width >= 2, got {W}")
    if conv_state.dim() != 3 or conv_state.shape[1:] != (C, W - 1):
        raise ValueError(
            f"conv_state must be [num_slots, C={C}, W-1={W - 1}], got {list(conv_state.shape)}"
        )
    if conv_state.dtype not in FLOAT_DTYPES:
        raise ValueError(f"conv_state must be one of {FLOAT_DTYPES}, got {conv_state.dtype}")
    check_index_vector("state_slots", state_slots, B)
    check_same_device(
        "x", x, conv_state=conv_state, state_slots=state_slots, meta=meta.conv_sources
    )
    if host_readable(state_slots) and bool((state_slots >= conv_state.shape[0]).any()):
        raise ValueError(
            f"state_slots must be < num_slots = {conv_state.shape[0]} (or < 0 for padding), "
            f"got {state_slots.tolist()}"
        )
    return B, N, C, W


def _inputs_with_state(
    x: torch.Tensor, conv_state: torch.Tensor, state_slots: torch.Tensor
) -> torch.Tensor:
    """[B, W-1+N, C] float32: committed columns then node inputs, so that
    ``conv_sources + W - 1`` indexes it for both kinds of source."""
    slots = state_slots.long()
    committed = conv_state[slots.clamp(min=0)].float().transpose(1, 2)
    committed = torch.where((slots >= 0).view(-1, 1, 1), committed, 0.0)
    return torch.cat([committed, x.float()], dim=1)


def tree_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    state_slots: torch.Tensor,
    meta: TreeMetadata,
    activation: str | None = "silu",
    backend: str = "auto",
    out: torch.Tensor | None = None,
    inputs_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Depthwise causal conv over draft trees, reading ancestors instead of predecessors.

    Args:
        x: [B, N, C] node inputs (bf16/fp16/fp32), any strides.
        weight: [C, W] taps in causal-conv order: ``weight[:, W-1]`` multiplies the
            node itself, ``weight[:, W-1-t]`` its ``t``-th ancestor.
        bias: [C] or None.
        conv_state: [num_slots, C, W-1] committed inputs, columns oldest to
            newest, any strides (a view into the engine's buffer). Read only.
        state_slots: [B] int32/int64, each request's row of ``conv_state``; a
            negative slot (padding) reads a zero state.
        meta: tree metadata built with ``conv_width=W``.
        activation: ``"silu"`` or None.
        backend: ``"auto"`` (Triton on CUDA, PyTorch elsewhere), ``"torch"`` or
            ``"triton"`` (see :func:`triton_ops.utils.use_triton`).
        out: optional [B, N, C] tensor of x's dtype to write into (any strides).
        inputs_out: optional [B, N, C] tensor of x's dtype (any strides) that receives
            a copy of the real nodes' inputs, made while the kernel reads them (the engine
            keeps them for the commit when ``x`` is a buffer it does not own).

    Returns:
        [B, N, C] in x's dtype (``out`` when given), accumulated in fp32;
        padded nodes are zeros.
    """
    B, N, C, W = _check_common(x, conv_state, state_slots, meta)
    if weight.shape != (C, W):
        raise ValueError(f"weight must be [C={C}, W={W}], got {list(weight.shape)}")
    if bias is not None and bias.shape != (C,):
        raise ValueError(f"bias must be [C={C}] or None, got {list(bias.shape)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    out = output_buffer(out, (B, N, C), x.dtype, x.device, "[B, N, C]")
    if inputs_out is not None:
        output_buffer(inputs_out, (B, N, C), x.dtype, x.device, "[B, N, C]", name="inputs_out")

    if not use_triton(backend, x):
        if inputs_out is not None:
            inputs_out.copy_(torch.where(meta.valid.unsqueeze(-1), x, inputs_out))
        taps = _inputs_with_state(x, conv_state, state_slots)
        index = (meta.conv_sources.long() + (W - 1)).view(B, N * W, 1).expand(-1, -1, C)
        taps = torch.gather(taps, 1, index).view(B, N, W, C)
        # Tap t (t-th ancestor) pairs with weight column W-1-t.
        y = (taps * weight.float().flip(1).t()).sum(2)
        if bias is not None:
            y = y + bias.float()
        if activation == "silu":
            y = torch.nn.functional.silu(y)
        out.copy_(torch.where(meta.valid.unsqueeze(-1), y, 0.0))
        return out

    block_n, block_c, num_warps = CUDA_TILES
    launch_tree_conv1d(x, weight, bias, conv_state, state_slots, meta, activation, out,
                       block_n=min(block_n, triton.next_power_of_2(N)),
                       block_c=min(block_c, triton.next_power_of_2(C)), num_warps=num_warps,
                       inputs_out=inputs_out)
    return out


def launch_tree_conv1d(x, weight, bias, conv_state, state_slots, meta, activation, out,
                       block_n: int, block_c: int, num_warps: int,
                       inputs_out: torch.Tensor | None = None) -> None:
    """The Triton launch with explicit tiles (the benchmark sweeps them)."""
    B, N, C = x.shape
    sources = meta.conv_sources
    copy = out if inputs_out is None else inputs_out  # unused without COPY_X
    _tree_conv1d_kernel[(triton.cdiv(C, block_c), triton.cdiv(N, block_n), B)](
        x, weight, bias if bias is not None else weight, conv_state, state_slots, sources,
        meta.num_nodes, out, copy,
        N, C,
        *x.stride(), *weight.stride(), *conv_state.stride(), *sources.stride(), *out.stride(),
        *copy.stride(),
        W=weight.shape[1], HAS_BIAS=bias is not None, SILU=activation == "silu",
        COPY_X=inputs_out is not None, BLOCK_N=block_n, BLOCK_C=block_c,
        num_warps=num_warps,
    )


def tree_conv1d_commit(
    conv_state: torch.Tensor,
    state_slots: torch.Tensor,
    x: torch.Tensor,
    meta: TreeMetadata,
    accepted_leaf: torch.Tensor,
    backend: str = "auto",
) -> None:
    """Advance the conv state along the accepted path, in place.

    The new state of request ``b`` is the last W-1 columns of
    [old state ; x along the root-to-``accepted_leaf[b]`` path], cast to
    ``conv_state``'s dtype. ``accepted_leaf[b] = -1`` (or a negative slot) leaves
    the slot bit-identical. Shapes as in :func:`tree_conv1d`; ``accepted_leaf``
    is [B] int32/int64.
    """
    _check_commit(conv_state, state_slots, x, meta, accepted_leaf)
    if use_triton(backend, x):
        _launch_commit(conv_state, state_slots, x, meta, accepted_leaf)
    else:
        _commit_torch(conv_state, state_slots, x, meta, accepted_leaf)


def tree_conv1d_commit_layers(
    conv_states: Sequence[torch.Tensor],
    state_slots: Sequence[torch.Tensor],
    xs: Sequence[torch.Tensor],
    meta: TreeMetadata,
    accepted_leaf: torch.Tensor,
    backend: str = "auto",
) -> None:
    """:func:`tree_conv1d_commit` of several layers over the same trees, in one kernel
    launch on the Triton path. ``conv_states``, ``state_slots``, ``xs``: one per layer,
    every layer's of the same dtypes, shapes and strides. The launch reaches each layer
    through a table of its tensors' offsets (:func:`triton_ops.utils.layer_offsets`), made
    on the first call over these tensors: to capture the commit in a CUDA graph, run it
    once before."""
    if not len(conv_states) == len(state_slots) == len(xs) >= 1:
        raise ValueError(
            f"conv_states, state_slots and xs must hold one entry per layer (at least one), "
            f"got {len(conv_states)}, {len(state_slots)} and {len(xs)}"
        )
    for conv_state, slots, x in zip(conv_states, state_slots, xs):
        _check_commit(conv_state, slots, x, meta, accepted_leaf)
    if not use_triton(backend, xs[0]):
        for conv_state, slots, x in zip(conv_states, state_slots, xs):
            _commit_torch(conv_state, slots, x, meta, accepted_leaf)
        return
    # Columns in the commit kernel's argument order.
    layers = layer_offsets({"conv_states": conv_states, "state_slots": state_slots, "xs": xs})
    _launch_commit(conv_states[0], state_slots[0], xs[0], meta, accepted_leaf, layers)


def _check_commit(conv_state, state_slots, x, meta, accepted_leaf) -> None:
    _check_common(x, conv_state, state_slots, meta)
    check_same_device("x", x, accepted_leaf=accepted_leaf)
    check_accepted_leaf(accepted_leaf, meta)


def _commit_torch(conv_state, state_slots, x, meta, accepted_leaf) -> None:
    W = meta.conv_width
    rows = ((accepted_leaf >= 0) & (state_slots >= 0)).nonzero().squeeze(1)
    if rows.numel() == 0:
        return
    leaf = accepted_leaf[rows].long()
    # Column c of the new state (oldest to newest) is tap W-2-c of the leaf.
    taps = meta.conv_sources[rows, leaf, : W - 1].flip(-1).long() + (W - 1)
    inputs = _inputs_with_state(x[rows], conv_state, state_slots[rows])
    new_columns = torch.gather(inputs, 1, taps.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
    conv_state[state_slots[rows].long()] = new_columns.transpose(1, 2).to(conv_state.dtype)


def _launch_commit(conv_state, state_slots, x, meta, accepted_leaf, layers=None) -> None:
    """The commit kernel over one layer, or over every layer of ``layers`` (the [L, 3]
    table and alignment of tree_conv1d_commit_layers; the arguments being layer 0's)."""
    B, N, C = x.shape
    W = meta.conv_width
    BLOCK_C = min(256, triton.next_power_of_2(C))
    sources = meta.conv_sources
    # Without layers, ``offsets`` is never read.
    offsets, aligned = (accepted_leaf, False) if layers is None else layers
    num_layers = 1 if layers is None else offsets.shape[0]
    _tree_conv1d_commit_kernel[(triton.cdiv(C, BLOCK_C), B, num_layers)](
        conv_state, state_slots, x, sources, accepted_leaf, offsets,
        C,
        *conv_state.stride(), *x.stride(), *sources.stride(),
        W=W, BLOCK_T=triton.next_power_of_2(W - 1), BLOCK_C=BLOCK_C,
        LAYERS=layers is not None, ALIGNED=aligned, num_warps=4,
    )
