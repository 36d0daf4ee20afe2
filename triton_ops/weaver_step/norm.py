"""RMSNorm with weight and bias: y = x / sqrt(mean(x^2) + eps) * weight + bias, in fp32;
``add_rms_norm`` first adds a residual (one launch where the Weaver made two).

The Triton form runs one program per row (the whole row in registers); every
Weaver norm is at most 5120 wide.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton_ops.utils import check_same_device, use_triton


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """RMSNorm of ``x`` [..., D] over its last dimension, computed in fp32.

    ``weight``, ``bias``: [D] float. Returns x's shape and dtype. No autograd on the
    Triton path: differentiable callers take ``backend="torch"``.
    """
    _check_norm_inputs(x, weight, bias)
    if not use_triton(backend, x):
        return _torch_rms_norm(x, weight, bias, eps)
    return _launch(x, None, weight, bias, eps)[1]


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    *,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, rms_norm(s))`` with ``s = x + residual`` rounded to x's dtype, as the two ops
    apart give it; one launch on the Triton path (no autograd there, as ``rms_norm``)."""
    _check_norm_inputs(x, weight, bias)
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"residual must be x's {x.dtype} {list(x.shape)}, got {residual.dtype} "
                         f"{list(residual.shape)}")
    check_same_device("x", x, residual=residual)
    if not use_triton(backend, x):
        total = x + residual
        return total, _torch_rms_norm(total, weight, bias, eps)
    return _launch(x, residual, weight, bias, eps)


def _check_norm_inputs(x, weight, bias) -> None:
    width = x.shape[-1]
    for name, t in (("weight", weight), ("bias", bias)):
        if t.shape != (width,) or not t.is_floating_point():
            raise ValueError(f"{name} must be a float [{width}] tensor, got {t.dtype} "
                             f"{list(t.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"x must be a float tensor, got {x.dtype}")
    check_same_device("x", x, weight=weight, bias=bias)


def _torch_rms_norm(x, weight, bias, eps) -> torch.Tensor:
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * weight.float() + bias.float()).to(x.dtype)


def _launch(x, residual, weight, bias, eps) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(x + residual or None, the norm) through the kernel, both in x's shape and dtype."""
    width = x.shape[-1]
    rows = x.reshape(-1, width).contiguous()
    out = torch.empty_like(rows)
    total = None
    if residual is not None:
        residual = residual.reshape(-1, width).contiguous()
        total = torch.empty_like(rows)
    if rows.shape[0]:
        block = triton.next_power_of_2(width)
        _rms_norm_kernel[(rows.shape[0],)](
            rows, residual if residual is not None else rows, weight.contiguous(), bias.contiguous(),
            out, total if total is not None else out, width, rows.stride(0), eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)),
        )
    return None if total is None else total.view(x.shape), out.view(x.shape)


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, b_ptr, out_ptr, sum_ptr, WIDTH, stride, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < WIDTH
    x = tl.load(x_ptr + row * stride + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x += tl.load(res_ptr + row * stride + offs, mask=mask, other=0.0).to(tl.float32)
        # The norm reads the sum as stored, in x's dtype, as the two ops apart do.
        total = x.to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride + offs, total, mask=mask)
        x = total.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / WIDTH + eps)
    weight = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    bias = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = x * inv * weight + bias
    tl.store(out_ptr + row * stride + offs, y.to(out_ptr.dtype.element_ty), mask=mask)
