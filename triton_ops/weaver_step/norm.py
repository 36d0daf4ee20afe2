"""RMSNorm with weight and bias: y = x / sqrt(mean(x^2) + eps) * weight + bias, in fp32.

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
    triton_path = use_triton(backend, x)
    width = x.shape[-1]
    for name, t in (("weight", weight), ("bias", bias)):
        if t.shape != (width,) or not t.is_floating_point():
            raise ValueError(f"{name} must be a float [{width}] tensor, got {t.dtype} "
                             f"{list(t.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"x must be a float tensor, got {x.dtype}")
    check_same_device("x", x, weight=weight, bias=bias)
    if not triton_path:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return (normed * weight.float() + bias.float()).to(x.dtype)
    rows = x.reshape(-1, width).contiguous()
    out = torch.empty_like(rows)
    if rows.shape[0]:
        block = triton.next_power_of_2(width)
        _rms_norm_kernel[(rows.shape[0],)](
            rows, weight.contiguous(), bias.contiguous(), out, width, rows.stride(0), eps,
            BLOCK=block, num_warps=min(16, max(1, block // 256)),
        )
    return out.view(x.shape)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, b_ptr, out_ptr, WIDTH, stride, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < WIDTH
    x = tl.load(x_ptr + row * stride + offs, mask=mask, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / WIDTH + eps)
    weight = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    bias = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = x * inv * weight + bias
    tl.store(out_ptr + row * stride + offs, y.to(out_ptr.dtype.element_ty), mask=mask)
