"""What every tree op shares: the backend choice, argument checks and jit helpers.

Each op's public entry resolves ``backend=`` with :func:`use_triton`, checks its
arguments with the helpers below (errors name the argument), and its kernels
test ancestor bits with :func:`bit_is_set`. Checks that read tensor values run
only where that costs no host sync (:func:`host_readable`).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

BACKENDS = ("auto", "torch", "triton")
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


def interpreting() -> bool:
    """True when Triton kernels run in its interpreter, which takes CPU tensors.

    ``triton.jit`` reads ``TRITON_INTERPRET`` when a kernel is defined, so the
    variable must be set before ``triton_ops`` is imported.
    """
    return os.environ.get("TRITON_INTERPRET") == "1"


def use_triton(backend: str, like: torch.Tensor) -> bool:
    """Whether an op runs its Triton kernels for inputs on ``like``'s device.

    ``"auto"``: Triton for CUDA tensors, PyTorch elsewhere (what vLLM on CPU
    runs). ``"torch"``: the PyTorch path. ``"triton"``: the kernels; for tensors
    off CUDA only under the interpreter, anything else raises ValueError.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return like.is_cuda
    if backend == "triton" and not like.is_cuda and not interpreting():
        raise ValueError(
            f"backend='triton' needs CUDA tensors, got {like.device.type} tensors: set "
            "TRITON_INTERPRET=1 before importing triton_ops to run the kernels in Triton's "
            "interpreter, or pass backend='torch'"
        )
    return backend == "triton"


def host_readable(t: torch.Tensor) -> bool:
    """True where a check may read ``t``'s values: free off CUDA, a host sync per
    call on CUDA (which would also break graph capture), so CUDA skips them."""
    return not t.is_cuda


def check_same_device(reference: str, like: torch.Tensor, **tensors: torch.Tensor) -> None:
    """Every tensor in ``tensors`` must sit on the device of ``like`` (named ``reference``)."""
    for name, t in tensors.items():
        if t.device != like.device:
            raise ValueError(
                f"{name} must be on {reference}'s device {like.device}, got {t.device}"
            )


def check_index_vector(name: str, t: torch.Tensor, length: int) -> None:
    """``t`` must be an int32/int64 tensor of shape [length] (one entry per request)."""
    if t.shape != (length,) or t.dtype not in INDEX_DTYPES:
        raise ValueError(
            f"{name} must be an int32/int64 [{length}] tensor, got {t.dtype} {list(t.shape)}"
        )


def output_buffer(
    out: torch.Tensor | None,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    dims: str,
) -> torch.Tensor:
    """``out`` once it matches what the op writes (any strides), else a new
    contiguous tensor; ``dims`` names the shape in the error, e.g. ``"[B, N, C]"``."""
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype or out.device != torch.device(device):
        raise ValueError(
            f"out must be {dims} = {list(shape)} {dtype} on {device}, "
            f"got {list(out.shape)} {out.dtype} on {out.device}"
        )
    return out


def dot_block(n: int) -> int:
    """Block side covering ``n``: a power of two, at least 16 (``tl.dot``'s minimum)."""
    return max(16, triton.next_power_of_2(n))


@triton.jit
def bit_is_set(words, bits):
    """Bit ``bits % 64`` of each int64 in ``words``, as bool: the ancestor test on
    ``TreeMetadata.ancestor_words``, whose word ``j // 64`` holds node ``j``."""
    return ((words >> tl.cast(bits % 64, tl.int64)) & 1) != 0
