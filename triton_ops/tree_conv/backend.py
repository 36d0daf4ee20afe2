"""Choice between the vectorised PyTorch path and the Triton kernels of a tree op."""

from __future__ import annotations

import torch

BACKENDS = ("auto", "torch", "triton")


def use_triton(backend: str, device: torch.device) -> bool:
    """True when the op should launch its Triton kernel.

    ``"auto"`` picks Triton for CUDA tensors and PyTorch elsewhere (what vLLM on
    CPU runs); ``"triton"`` forces the kernel, which on CPU tensors only works
    under ``TRITON_INTERPRET=1`` (the tests use that).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return device.type == "cuda"
    return backend == "triton"
