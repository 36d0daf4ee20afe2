"""Rollback-free tree verification for Gated DeltaNet: the public entry points.

Verification scores every node of a draft tree with the ancestor-masked chunk
form of the gated delta rule (DESIGN.md section 4) and writes no recurrent
state. Once a path is accepted, :func:`gdn_tree_commit` advances each request's
state along that path only, from quantities verification already produced:

    G      = Mbar g                                       path sums of the log decay
    A_ij   = M_ij beta_i exp(G_i - G_j) (k_i . k_j)       strictly lower triangular
    (I + A) Delta = diag(beta) (V - diag(e^G) K S0)
    O      = diag(e^G) Q S0 + (Q K^T (.) exp(G_i - G_j) (.) Mbar) Delta
    S*     = e^{G_l} S0 + K_pi^T diag(exp(G_l - G_pi)) Delta_pi

Every decay factor is formed as ``exp(where(mask, G_i - G_j, -inf))``: between
nodes that are not ancestor and descendant the difference can be thousands of
nats, and masking after the exponential would give ``inf * 0``.

CUDA tensors run the Triton kernels (:mod:`.chunk_triton`), CPU tensors a
batched PyTorch form (:mod:`.chunk_torch`); ``backend=`` overrides the choice.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from triton_ops.tree_metadata import TreeMetadata, check_accepted_leaf, check_node_tensor
from triton_ops.utils import (
    FLOAT_DTYPES,
    check_index_vector,
    check_same_device,
    host_readable,
    layer_offsets,
    output_buffer,
    use_triton,
)

# Dot-product precision of the Triton kernels for fp32 operands: "tf32" rounds
# operands to 10 mantissa bits (~1e-3 relative error), "tf32x3" splits each
# operand in two tf32 halves (~1e-6, three tensor-core passes), "ieee" uses
# plain fp32 FMAs (exact fp32, no tensor cores, slowest).
PRECISIONS = ("tf32x3", "tf32", "ieee")
DEFAULT_PRECISION = "tf32x3"
MAX_HEAD_DIM = 256
_STATE_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class GDNTreeVerifyOutput:
    """What :func:`gdn_tree_verify` returns; :func:`gdn_tree_commit` consumes it.

    Attributes:
        o: [B, N, HV, V] in v's dtype, each node's output; zeros at padding nodes.
            :func:`gdn_tree_commit` never reads it: a record kept for the commit only
            may hold None (:meth:`for_commit`).
        delta: [B, N, HV, V] fp32 (float64 for float64 inputs), the solved
            ``Delta`` rows; zeros at padding nodes.
        gate_sum: [B, N, HV] float64, ``G``: the log decay summed from the
            committed state down to each node; 0 at padding. Kept in float64
            because only differences ``G_i - G_j`` enter the decays and path
            sums can reach thousands of nats, where fp32 keeps ~1e-3 absolute.
        k_normed: [B, N, H, K] fp32 (float64 likewise), the keys as the
            recurrence used them (L2-normalised when requested); 0 at padding.
    """

    o: torch.Tensor | None
    delta: torch.Tensor
    gate_sum: torch.Tensor
    k_normed: torch.Tensor

    def for_commit(self) -> GDNTreeVerifyOutput:
        """What the commit reads, without ``o`` (whose memory the caller may reuse)."""
        return replace(self, o=None)


# allocate(name, shape, dtype, device) -> an uninitialised tensor of that shape and dtype
# for the verify output's field ``name`` ("delta", "gate_sum", "k_normed").
Allocate = Callable[[str, tuple[int, ...], torch.dtype, torch.device], torch.Tensor]


def new_tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype,
               device: torch.device) -> torch.Tensor:
    """The default :data:`Allocate`: a new tensor each call."""
    return torch.empty(shape, dtype=dtype, device=device)


def commit_fields(q: torch.Tensor, v: torch.Tensor,
                  allocate: Allocate = new_tensor) -> dict[str, torch.Tensor]:
    """The verify output's fields the commit reads, allocated for inputs ``q`` [B, N, H, K]
    and ``v`` [B, N, HV, V]: fp32 (float64 for float64 inputs), ``gate_sum`` float64."""
    B, N, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    fields = {}
    for name, shape, field_dtype, dims in (("delta", (B, N, HV, V), dtype, "[B, N, HV, V]"),
                                           ("gate_sum", (B, N, HV), torch.float64, "[B, N, HV]"),
                                           ("k_normed", (B, N, H, K), dtype, "[B, N, H, K]")):
        tensor = output_buffer(allocate(name, shape, field_dtype, q.device), shape, field_dtype,
                               q.device, dims, name=f"allocate's {name}")
        if not tensor.is_contiguous():  # the kernels write them row-major
            raise ValueError(f"allocate's {name} must be contiguous, got strides {tensor.stride()}")
        fields[name] = tensor
    return fields


def gdn_tree_verify(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_state: torch.Tensor,
    state_slots: torch.Tensor,
    meta: TreeMetadata,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    *,
    backend: str = "auto",
    precision: str = DEFAULT_PRECISION,
    out: torch.Tensor | None = None,
    allocate: Allocate = new_tensor,
) -> GDNTreeVerifyOutput:
    """Score all tree nodes of a GDN layer without writing any state.

    Args:
        q, k: [B, N, H, K] float (fp16/bf16/fp32; float64 on the torch backend), any strides.
        v: [B, N, HV, V], q's dtype; HV a multiple of H, value head ``h`` reads
            key head ``h // (HV // H)``.
        g: [B, N, HV] fp32 (float64 with float64 inputs) log decay, ``<= 0``.
        beta: [B, N, HV] any float dtype.
        ssm_state: [num_slots, HV, K, V] fp32 or bf16, any strides (vLLM's pool
            is [slots, HV, V, K]: pass ``pool.transpose(-1, -2)``); read only.
        state_slots: [B] int32/int64, the slot of each request's committed state.
        meta: tree topology of the step; padding nodes get zero outputs and
            never read state.
        scale: query scale, ``K ** -0.5`` by default.
        use_qk_l2norm: L2-normalise q and k first (eps 1e-6, as fla does).
        backend: "auto" (Triton for CUDA tensors, PyTorch otherwise), "torch",
            or "triton" (see :func:`triton_ops.utils.use_triton`).
        precision: dot precision of the Triton kernels, one of ``PRECISIONS``.
        out: optional contiguous [B, N, HV, V] tensor of v's dtype that becomes the
            output's ``o`` (the engine passes its layer's output rows when they hold the
            nodes in this order, which saves a copy per layer).
        allocate: how the fields the commit reads are allocated (:data:`Allocate`; every
            element is written): the engine reuses one set of buffers from step to step.

    Returns:
        :class:`GDNTreeVerifyOutput`.
    """
    triton_path = use_triton(backend, q)
    _check_verify_inputs(q, k, v, g, beta, ssm_state, state_slots, meta, triton_path, precision)
    if out is not None:
        # The kernels write o row-major.
        B, N, _, _ = q.shape
        output_buffer(out, (B, N, *v.shape[2:]), v.dtype, v.device, "[B, N, HV, V]")
        if not out.is_contiguous():
            raise ValueError(f"out must be contiguous, got strides {out.stride()}")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if triton_path:
        from triton_ops.gdn_tree.chunk_triton import verify_triton

        return verify_triton(q, k, v, g, beta, ssm_state, state_slots, meta, scale,
                             use_qk_l2norm, precision, o=out, allocate=allocate)
    from triton_ops.gdn_tree.chunk_torch import verify_torch

    result = verify_torch(q, k, v, g, beta, ssm_state, state_slots, meta, scale, use_qk_l2norm)
    if allocate is not new_tensor:
        fields = commit_fields(q, v, allocate)
        result = replace(result, **{name: fields[name].copy_(getattr(result, name))
                                    for name in fields})
    if out is None:
        return result
    return replace(result, o=out.copy_(result.o))


def gdn_tree_commit(
    ssm_state: torch.Tensor,
    state_slots: torch.Tensor,
    meta: TreeMetadata,
    verify_out: GDNTreeVerifyOutput,
    accepted_leaf: torch.Tensor,
    *,
    backend: str = "auto",
    precision: str = DEFAULT_PRECISION,
) -> None:
    """Advance each request's state in place along its accepted path.

    ``S* = e^{G_l} S0 + K_pi^T diag(exp(G_l - G_pi)) Delta_pi`` where ``pi``
    is the root-to-``l`` path; this equals running the recurrence node by node
    along ``pi``.

    Args:
        ssm_state: the pool given to :func:`gdn_tree_verify`, written in place.
        state_slots: [B] the slots given to :func:`gdn_tree_verify`.
        meta: the step's tree metadata.
        verify_out: what :func:`gdn_tree_verify` returned for this layer.
        accepted_leaf: [B] int32/int64, the last accepted node of each request,
            or -1: nothing accepted, the slot is left bit-identical.
        backend, precision: as in :func:`gdn_tree_verify`.
    """
    triton_path = use_triton(backend, ssm_state)
    _check_commit_inputs(ssm_state, state_slots, meta, verify_out, accepted_leaf, precision)
    if triton_path:
        from triton_ops.gdn_tree.chunk_triton import commit_triton

        commit_triton(ssm_state, state_slots, meta, verify_out, accepted_leaf, precision)
        return
    from triton_ops.gdn_tree.chunk_torch import commit_torch

    commit_torch(ssm_state, state_slots, meta, verify_out, accepted_leaf)


def gdn_tree_commit_layers(
    ssm_states: Sequence[torch.Tensor],
    state_slots: Sequence[torch.Tensor],
    meta: TreeMetadata,
    verify_outs: Sequence[GDNTreeVerifyOutput],
    accepted_leaf: torch.Tensor,
    *,
    backend: str = "auto",
    precision: str = DEFAULT_PRECISION,
) -> None:
    """:func:`gdn_tree_commit` of several layers over the same trees (a step's GDN
    layers), in one kernel launch on the Triton path.

    Args:
        ssm_states, state_slots, verify_outs: one per layer, each as
            :func:`gdn_tree_commit` takes it; every layer's of the same dtypes, shapes
            and strides (the pools themselves may lie anywhere).
        meta, accepted_leaf, backend, precision: as in :func:`gdn_tree_commit`.

    The launch reaches each layer through a table of its tensors' offsets
    (:func:`triton_ops.utils.layer_offsets`), made on the first call over these
    tensors: to capture the commit in a CUDA graph, run it once before.
    """
    if not len(ssm_states) == len(state_slots) == len(verify_outs) >= 1:
        raise ValueError(
            f"ssm_states, state_slots and verify_outs must hold one entry per layer (at least "
            f"one), got {len(ssm_states)}, {len(state_slots)} and {len(verify_outs)}"
        )
    for ssm_state, slots, out in zip(ssm_states, state_slots, verify_outs):
        _check_commit_inputs(ssm_state, slots, meta, out, accepted_leaf, precision)
    if not use_triton(backend, ssm_states[0]):
        from triton_ops.gdn_tree.chunk_torch import commit_torch

        for ssm_state, slots, out in zip(ssm_states, state_slots, verify_outs):
            commit_torch(ssm_state, slots, meta, out, accepted_leaf)
        return
    from triton_ops.gdn_tree.chunk_triton import commit_triton

    commit_triton(ssm_states[0], state_slots[0], meta, verify_outs[0], accepted_leaf, precision,
                  layers=commit_layer_table(ssm_states, state_slots, verify_outs))


def commit_layer_table(
    ssm_states: Sequence[torch.Tensor],
    state_slots: Sequence[torch.Tensor],
    verify_outs: Sequence[GDNTreeVerifyOutput],
) -> tuple[torch.Tensor, bool]:
    """The [L, 5] offsets table (and its alignment) through which one commit launch
    reaches L layers' tensors (:func:`triton_ops.utils.layer_offsets`)."""
    # Columns in the commit kernel's argument order.
    return layer_offsets({
        "ssm_states": ssm_states,
        "state_slots": state_slots,
        "verify_outs.delta": [out.delta for out in verify_outs],
        "verify_outs.gate_sum": [out.gate_sum for out in verify_outs],
        "verify_outs.k_normed": [out.k_normed for out in verify_outs],
    })


def _check_slots(state_slots: torch.Tensor, batch: int, num_slots: int) -> None:
    check_index_vector("state_slots", state_slots, batch)
    if host_readable(state_slots) and bool(((state_slots < 0) | (state_slots >= num_slots)).any()):
        raise ValueError(f"state_slots must lie in [0, {num_slots}), got {state_slots.tolist()}")


def _check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")


def _check_verify_inputs(q, k, v, g, beta, ssm_state, state_slots, meta, triton_path, precision):
    _check_precision(precision)
    check_node_tensor(meta, "q", q, ("H", "K"))
    B, N, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape {list(q.shape)}, got {list(k.shape)}")
    check_node_tensor(meta, "v", v, ("HV", "V"))
    HV, V = v.shape[2], v.shape[3]
    if H == 0 or HV % H != 0:
        raise ValueError(f"v's head count HV={HV} must be a multiple of q's H={H}")
    for name, dim in (("K", K), ("V", V)):
        if not 1 <= dim <= MAX_HEAD_DIM:
            raise ValueError(f"head dim {name}={dim} must lie in [1, {MAX_HEAD_DIM}]")
    # float64 is the torch path's exact mode; the kernels compute in fp32.
    allowed = FLOAT_DTYPES if triton_path else (*FLOAT_DTYPES, torch.float64)
    if q.dtype not in allowed:
        raise ValueError(f"q must have one of the dtypes {allowed}, got {q.dtype}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise ValueError(f"{name} must have q's dtype {q.dtype}, got {t.dtype}")
    want_g = torch.float64 if q.dtype == torch.float64 else torch.float32
    if g.shape != (B, N, HV) or g.dtype != want_g:
        raise ValueError(f"g must be a {want_g} [{B}, {N}, {HV}] tensor, got {g.dtype} {list(g.shape)}")
    if beta.shape != (B, N, HV) or beta.dtype not in allowed:
        raise ValueError(
            f"beta must be a float [{B}, {N}, {HV}] tensor, got {beta.dtype} {list(beta.shape)}"
        )
    if ssm_state.dim() != 4 or ssm_state.shape[1:] != (HV, K, V):
        raise ValueError(
            f"ssm_state must be [num_slots, HV={HV}, K={K}, V={V}], got {list(ssm_state.shape)}"
        )
    if ssm_state.dtype not in _STATE_DTYPES:
        raise ValueError(f"ssm_state must be one of {_STATE_DTYPES}, got {ssm_state.dtype}")
    check_same_device(
        "q", q, k=k, v=v, g=g, beta=beta, ssm_state=ssm_state, state_slots=state_slots,
        meta=meta.parents,
    )
    _check_slots(state_slots, B, ssm_state.shape[0])


def _check_commit_inputs(ssm_state, state_slots, meta, verify_out, accepted_leaf, precision):
    _check_precision(precision)
    if not isinstance(verify_out, GDNTreeVerifyOutput):
        raise ValueError(f"verify_out must be a GDNTreeVerifyOutput, got {type(verify_out).__name__}")
    check_node_tensor(meta, "verify_out.delta", verify_out.delta, ("HV", "V"))
    B, N, HV, V = verify_out.delta.shape
    K = verify_out.k_normed.shape[-1]
    if ssm_state.dim() != 4 or ssm_state.shape[1:] != (HV, K, V):
        raise ValueError(
            f"ssm_state must be [num_slots, HV={HV}, K={K}, V={V}] like the verified "
            f"layer, got {list(ssm_state.shape)}"
        )
    if ssm_state.dtype not in _STATE_DTYPES:
        raise ValueError(f"ssm_state must be one of {_STATE_DTYPES}, got {ssm_state.dtype}")
    check_accepted_leaf(accepted_leaf, meta)
    check_same_device(
        "ssm_state", ssm_state, state_slots=state_slots, meta=meta.parents,
        accepted_leaf=accepted_leaf, verify_out=verify_out.delta,
    )
    _check_slots(state_slots, B, ssm_state.shape[0])
