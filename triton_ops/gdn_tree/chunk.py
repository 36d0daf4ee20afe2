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

import os
from dataclasses import dataclass

import torch

from triton_ops.tree_metadata import TreeMetadata, check_accepted_leaf

BACKENDS = ("auto", "torch", "triton")
# Dot-product precision of the Triton kernels for fp32 operands: "tf32" rounds
# operands to 10 mantissa bits (~1e-3 relative error), "tf32x3" splits each
# operand in two tf32 halves (~1e-6, three tensor-core passes), "ieee" uses
# plain fp32 FMAs (exact fp32, no tensor cores, slowest).
PRECISIONS = ("tf32x3", "tf32", "ieee")
DEFAULT_PRECISION = "tf32x3"
MAX_HEAD_DIM = 256
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_STATE_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class GDNTreeVerifyOutput:
    """What :func:`gdn_tree_verify` returns; :func:`gdn_tree_commit` consumes it.

    Attributes:
        o: [B, N, HV, V] in v's dtype, each node's output; zeros at padding nodes.
        delta: [B, N, HV, V] fp32 (float64 for float64 inputs), the solved
            ``Delta`` rows; zeros at padding nodes.
        gate_sum: [B, N, HV] float64, ``G``: the log decay summed from the
            committed state down to each node; 0 at padding. Kept in float64
            because only differences ``G_i - G_j`` enter the decays and path
            sums can reach thousands of nats, where fp32 keeps ~1e-3 absolute.
        k_normed: [B, N, H, K] fp32 (float64 likewise), the keys as the
            recurrence used them (L2-normalised when requested); 0 at padding.
    """

    o: torch.Tensor
    delta: torch.Tensor
    gate_sum: torch.Tensor
    k_normed: torch.Tensor


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
            or "triton" (CPU tensors need ``TRITON_INTERPRET=1``).
        precision: dot precision of the Triton kernels, one of ``PRECISIONS``.

    Returns:
        :class:`GDNTreeVerifyOutput`.
    """
    use_triton = _resolve_backend(backend, q)
    _check_verify_inputs(q, k, v, g, beta, ssm_state, state_slots, meta, use_triton, precision)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if use_triton:
        from triton_ops.gdn_tree.chunk_triton import verify_triton

        return verify_triton(
            q, k, v, g, beta, ssm_state, state_slots, meta, scale, use_qk_l2norm, precision
        )
    from triton_ops.gdn_tree.chunk_torch import verify_torch

    return verify_torch(q, k, v, g, beta, ssm_state, state_slots, meta, scale, use_qk_l2norm)


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
    use_triton = _resolve_backend(backend, ssm_state)
    _check_commit_inputs(ssm_state, state_slots, meta, verify_out, accepted_leaf, precision)
    if use_triton:
        from triton_ops.gdn_tree.chunk_triton import commit_triton

        commit_triton(ssm_state, state_slots, meta, verify_out, accepted_leaf, precision)
        return
    from triton_ops.gdn_tree.chunk_torch import commit_torch

    commit_torch(ssm_state, state_slots, meta, verify_out, accepted_leaf)


def _resolve_backend(backend: str, like: torch.Tensor) -> bool:
    """True when the Triton kernels run."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return like.is_cuda
    if backend == "triton" and not like.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("backend='triton' on CPU tensors needs TRITON_INTERPRET=1")
    return backend == "triton"


def _check_same_device(device: torch.device, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, expected {device} like the other inputs")


def _check_slots(state_slots: torch.Tensor, batch: int, num_slots: int) -> None:
    if state_slots.shape != (batch,) or state_slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"state_slots must be an int32/int64 [{batch}] tensor, "
            f"got {state_slots.dtype} {list(state_slots.shape)}"
        )
    # On CUDA the range check would cost a host sync per layer; CPU pays nothing.
    if not state_slots.is_cuda and bool(((state_slots < 0) | (state_slots >= num_slots)).any()):
        raise ValueError(f"state_slots must lie in [0, {num_slots}), got {state_slots.tolist()}")


def _check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")


def _check_verify_inputs(q, k, v, g, beta, ssm_state, state_slots, meta, use_triton, precision):
    _check_precision(precision)
    if q.dim() != 4:
        raise ValueError(f"q must be [B, N, H, K], got shape {list(q.shape)}")
    B, N, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape {list(q.shape)}, got {list(k.shape)}")
    if v.dim() != 4 or v.shape[:2] != (B, N):
        raise ValueError(f"v must be [B={B}, N={N}, HV, V], got shape {list(v.shape)}")
    HV, V = v.shape[2], v.shape[3]
    if H == 0 or HV % H != 0:
        raise ValueError(f"v's head count HV={HV} must be a multiple of q's H={H}")
    for name, dim in (("K", K), ("V", V)):
        if not 1 <= dim <= MAX_HEAD_DIM:
            raise ValueError(f"head dim {name}={dim} must lie in [1, {MAX_HEAD_DIM}]")
    allowed = _FLOAT_DTYPES[:3] if use_triton else _FLOAT_DTYPES
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
    _check_meta(meta, B, N)
    _check_same_device(
        q.device, k=k, v=v, g=g, beta=beta, ssm_state=ssm_state, state_slots=state_slots,
        meta=meta.parents,
    )
    _check_slots(state_slots, B, ssm_state.shape[0])


def _check_meta(meta: TreeMetadata, batch: int, nodes: int) -> None:
    if not isinstance(meta, TreeMetadata):
        raise ValueError(f"meta must be a TreeMetadata, got {type(meta).__name__}")
    if (meta.batch_size, meta.max_nodes) != (batch, nodes):
        raise ValueError(
            f"meta describes B={meta.batch_size}, N={meta.max_nodes} but the inputs have "
            f"B={batch}, N={nodes}"
        )


def _check_commit_inputs(ssm_state, state_slots, meta, verify_out, accepted_leaf, precision):
    _check_precision(precision)
    if not isinstance(verify_out, GDNTreeVerifyOutput):
        raise ValueError(f"verify_out must be a GDNTreeVerifyOutput, got {type(verify_out).__name__}")
    B, N, HV, V = verify_out.delta.shape
    K = verify_out.k_normed.shape[-1]
    if ssm_state.dim() != 4 or ssm_state.shape[1:] != (HV, K, V):
        raise ValueError(
            f"ssm_state must be [num_slots, HV={HV}, K={K}, V={V}] like the verified "
            f"layer, got {list(ssm_state.shape)}"
        )
    if ssm_state.dtype not in _STATE_DTYPES:
        raise ValueError(f"ssm_state must be one of {_STATE_DTYPES}, got {ssm_state.dtype}")
    _check_meta(meta, B, N)
    if accepted_leaf.is_cuda:
        _check_leaf_shape(accepted_leaf, B)
    else:
        check_accepted_leaf(accepted_leaf, meta)
    _check_same_device(
        ssm_state.device, state_slots=state_slots, meta=meta.parents, accepted_leaf=accepted_leaf,
        delta=verify_out.delta,
    )
    _check_slots(state_slots, B, ssm_state.shape[0])


def _check_leaf_shape(accepted_leaf: torch.Tensor, batch: int) -> None:
    # The value range check of check_accepted_leaf would sync the host on CUDA.
    if accepted_leaf.shape != (batch,) or accepted_leaf.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"accepted_leaf must be an int32/int64 [{batch}] tensor, "
            f"got {accepted_leaf.dtype} {list(accepted_leaf.shape)}"
        )
