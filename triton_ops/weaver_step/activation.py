"""SwiGLU's gate: silu(gate) * up of a [..., 2M] projection whose halves are gate | up,
computed in fp32 and rounded once (one launch where the Weaver made two)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton_ops.utils import use_triton


def silu_mul(gate_up: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """``silu(gate) * up`` [..., M] of ``gate_up`` [..., 2M] (gate first), in its dtype.

    No autograd on the Triton path: differentiable callers take ``backend="torch"``.
    """
    if not gate_up.is_floating_point() or gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up must be a float [..., 2M] tensor, got {gate_up.dtype} "
                         f"{list(gate_up.shape)}")
    width = gate_up.shape[-1] // 2
    if not use_triton(backend, gate_up):
        gate, up = gate_up.float().chunk(2, dim=-1)
        return (torch.nn.functional.silu(gate) * up).to(gate_up.dtype)
    rows = gate_up.reshape(-1, 2 * width).contiguous()
    out = torch.empty(rows.shape[0], width, dtype=gate_up.dtype, device=gate_up.device)
    if rows.shape[0]:
        block = triton.next_power_of_2(width)
        _silu_mul_kernel[(rows.shape[0],)](rows, out, width, rows.stride(0), out.stride(0),
                                           BLOCK=block, num_warps=min(8, max(1, block // 256)))
    return out.view(*gate_up.shape[:-1], width)


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, WIDTH, stride_in, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < WIDTH
    gate = tl.load(gate_up_ptr + row * stride_in + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + WIDTH + offs, mask=mask, other=0.0).to(tl.float32)
    y = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * stride_out + offs, y.to(out_ptr.dtype.element_ty), mask=mask)
