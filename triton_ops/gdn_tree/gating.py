"""The gates of a GDN layer's tree nodes in one launch.

    g = -exp(A_log) * softplus(a + dt_bias)      (log decay per node and value head)
    beta = sigmoid(b)                            (write strength)

Qwen3-Next / Qwen3.5 gating. vLLM fuses it into its own decode kernels; computed in
PyTorch it is about ten elementwise launches per layer, each ~2 us on the H200, more than
the tree verify's own launch count. fp32 throughout, as vLLM's kernels compute it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton_ops.utils import FLOAT_DTYPES, check_same_device, output_buffer, use_triton

# torch.nn.functional.softplus's default: above it softplus(x) is x in fp32.
SOFTPLUS_THRESHOLD = 20.0
BLOCK_ROWS = 32


@triton.jit
def _gdn_gating_kernel(
    a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, g_ptr, beta_ptr,
    rows, HV,
    stride_ar, stride_ah, stride_br, stride_bh,
    BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
    THRESHOLD: tl.constexpr,
):
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_h = tl.arange(0, BLOCK_H)
    head_mask = offs_h < HV
    mask = (offs_r[:, None] < rows) & head_mask[None, :]
    a = tl.load(a_ptr + offs_r[:, None] * stride_ar + offs_h[None, :] * stride_ah,
                mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + offs_r[:, None] * stride_br + offs_h[None, :] * stride_bh,
                mask=mask, other=0.0).to(tl.float32)
    a_log = tl.load(a_log_ptr + offs_h, mask=head_mask, other=0.0).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + offs_h, mask=head_mask, other=0.0).to(tl.float32)
    x = a + dt_bias[None, :]
    # softplus(x) = max(x, 0) + log1p(exp(-|x|)), overflow-free; log1p(e) as
    # log(u) * e / (u - 1) with u = 1 + e rounded, which cancels u's rounding error
    # (log(1 + e) alone loses e's low bits).
    e = tl.exp(-tl.abs(x))
    u = 1.0 + e
    rounded_to_one = u == 1.0
    log1p_e = tl.where(rounded_to_one, e,
                       tl.log(u) * (e / tl.where(rounded_to_one, 1.0, u - 1.0)))
    softplus = tl.where(x > THRESHOLD, x, tl.maximum(x, 0.0) + log1p_e)
    g = -tl.exp(a_log)[None, :] * softplus
    e_b = tl.exp(-tl.abs(b))  # sigmoid without exp overflow
    beta = tl.where(b >= 0, 1.0, e_b) / (1.0 + e_b)
    out = offs_r[:, None] * HV + offs_h[None, :]
    tl.store(g_ptr + out, g, mask=mask)
    tl.store(beta_ptr + out, beta, mask=mask)


def gdn_gating(
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    backend: str = "auto",
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, beta) of every node, fp32, shaped like ``a``.

    Args:
        a, b: [..., HV] per node and value head (bf16/fp16/fp32), any strides that
            flatten to rows without a copy (a copy is made otherwise).
        A_log, dt_bias: [HV] the layer's parameters.
        backend: ``"auto"`` (Triton on CUDA, PyTorch elsewhere), ``"torch"`` or
            ``"triton"`` (see :func:`triton_ops.utils.use_triton`).
        out: optional (g, beta) contiguous fp32 tensors of ``a``'s shape to write into.
    """
    if a.shape != b.shape or a.dim() == 0:
        raise ValueError(f"a and b must share one shape [..., HV], got {list(a.shape)} and "
                         f"{list(b.shape)}")
    HV = a.shape[-1]
    for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
        if t.shape != (HV,):
            raise ValueError(f"{name} must be [HV={HV}], got {list(t.shape)}")
    for name, t in (("a", a), ("b", b), ("A_log", A_log), ("dt_bias", dt_bias)):
        if t.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name} must be one of {FLOAT_DTYPES}, got {t.dtype}")
    check_same_device("a", a, b=b, A_log=A_log, dt_bias=dt_bias)
    g_out, beta_out = out if out is not None else (None, None)
    g = output_buffer(g_out, tuple(a.shape), torch.float32, a.device, "[..., HV]")
    beta = output_buffer(beta_out, tuple(a.shape), torch.float32, a.device, "[..., HV]")
    if not (g.is_contiguous() and beta.is_contiguous()):
        raise ValueError("out must hold contiguous tensors")

    if not use_triton(backend, a):
        g.copy_(-torch.exp(A_log.float())
                * torch.nn.functional.softplus(a.float() + dt_bias.float()))
        beta.copy_(torch.sigmoid(b.float()))
        return g, beta

    a_rows, b_rows = a.reshape(-1, HV), b.reshape(-1, HV)
    rows = a_rows.shape[0]
    if rows:
        _gdn_gating_kernel[(triton.cdiv(rows, BLOCK_ROWS),)](
            a_rows, b_rows, A_log, dt_bias, g, beta, rows, HV,
            *a_rows.stride(), *b_rows.stride(),
            BLOCK_R=BLOCK_ROWS, BLOCK_H=triton.next_power_of_2(HV),
            THRESHOLD=SOFTPLUS_THRESHOLD,
        )
    return g, beta
