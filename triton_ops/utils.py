"""What every tree op shares: the backend choice, argument checks and jit helpers.

Each op's public entry resolves ``backend=`` with :func:`use_triton`, checks its
arguments with the helpers below (errors name the argument), and its kernels
test ancestor bits with :func:`bit_is_set`. Checks that read tensor values run
only where that costs no host sync (:func:`host_readable`). Ops that serve several
layers in one launch read the layers' addresses from a :func:`device_table`.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Sequence

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
    name: str = "out",
) -> torch.Tensor:
    """``out`` once it matches what the op writes (any strides), else a new
    contiguous tensor; ``dims`` names the shape in the error, e.g. ``"[B, N, C]"``,
    and ``name`` the argument."""
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype or out.device != torch.device(device):
        raise ValueError(
            f"{name} must be {dims} = {list(shape)} {dtype} on {device}, "
            f"got {list(out.shape)} {out.dtype} on {out.device}"
        )
    return out


# Device int64 tables by content (kernels that serve several layers in one launch read
# their layers' addresses from one). Engine caches never move and a CUDA graph's buffers are
# fixed, so after the first step a table is found here, and a graph capture, which may not
# copy from the host, finds it ready. Content-keyed: a hit is right whatever tensors now
# live at those addresses. Eager steps over fresh tensors make new tables, so the cache
# keeps the most recently used; a table a graph captured moves to _GRAPH_TABLES for good,
# since every replay reads its address (evicted, its memory went to other tensors and the
# replayed commit read garbage offsets: an illegal memory access on the H100, 2026-12-06).
_DEVICE_TABLES: OrderedDict[tuple, torch.Tensor] = OrderedDict()
_MAX_DEVICE_TABLES = 32
_GRAPH_TABLES: dict[tuple, torch.Tensor] = {}


def capturing_graph(device: torch.device) -> bool:
    """Whether work queued on ``device`` now is being captured into a CUDA graph (not run)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def device_table(rows: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    """``rows`` as an int64 tensor on ``device``, from the cache when made before (least
    recently used tables leave first, except those a CUDA graph captured, which stay while
    the process lives). A new table is a host-to-device copy, which a CUDA graph capture
    does not allow: run the op once before capturing it."""
    key = (torch.device(device), tuple(tuple(row) for row in rows))
    table = _GRAPH_TABLES.get(key)
    if table is not None:
        return table
    table = _DEVICE_TABLES.get(key)
    if capturing_graph(key[0]):
        if table is None:
            raise RuntimeError("a new device table is a host-to-device copy, which CUDA graph "
                               "capture does not allow: run the op once before capturing it")
        _GRAPH_TABLES[key] = _DEVICE_TABLES.pop(key)
        return table
    if table is not None:
        _DEVICE_TABLES.move_to_end(key)
        return table
    table = torch.tensor(key[1], dtype=torch.int64)
    if key[0].type == "cuda":  # pinned: the copy does not wait for the stream's queued work
        table = table.pin_memory().to(device, non_blocking=True)
    _DEVICE_TABLES[key] = table
    if len(_DEVICE_TABLES) > _MAX_DEVICE_TABLES:
        _DEVICE_TABLES.popitem(last=False)
    return table


def layer_offsets(columns: dict[str, Sequence[torch.Tensor]]) -> tuple[torch.Tensor, bool]:
    """([L, len(columns)] int64 on the tensors' device (:func:`device_table`), aligned):
    the element offset of each layer's tensor from layer 0's, one column per named kind
    (e.g. every layer's state pool), and whether every offset is a multiple of 16 bytes
    (then :func:`layer_tensor` keeps layer 0's alignment, and loads vectorize as they do
    at layer 0). Kernels that serve several layers in one launch take layer 0's tensors and
    this table. A layer's tensors must match layer 0's in dtype, shape, strides and device;
    errors name the kind and the layer."""
    names = list(columns)
    layers = {len(tensors) for tensors in columns.values()}
    if len(layers) != 1 or 0 in layers:
        raise ValueError(f"{names} must each hold the same number (>= 1) of layers' tensors, "
                         f"got {[len(tensors) for tensors in columns.values()]}")
    first = [tensors[0] for tensors in columns.values()]
    device = first[0].device
    rows, aligned = [], True
    for layer in range(layers.pop()):
        row = []
        for name, base in zip(names, first):
            t = columns[name][layer]
            if (t.dtype, t.shape, t.stride(), t.device) != (base.dtype, base.shape, base.stride(), device):
                raise ValueError(
                    f"{name}[{layer}] must match {name}[0]'s dtype, shape, strides and device "
                    f"({base.dtype} {list(base.shape)} {base.stride()} on {device}), got "
                    f"{t.dtype} {list(t.shape)} {t.stride()} on {t.device}"
                )
            offset, rest = divmod(t.data_ptr() - base.data_ptr(), t.element_size())
            if rest:
                raise ValueError(f"{name}[{layer}] must be aligned to its element size "
                                 f"({t.element_size()} bytes) like {name}[0]")
            row.append(offset)
            aligned &= offset * t.element_size() % 16 == 0
        rows.append(row)
    return device_table(rows, device), aligned


@triton.jit
def layer_tensor(base, row, column: tl.constexpr, ALIGNED: tl.constexpr):
    """``base`` (layer 0's pointer) moved to one layer's tensor by entry ``column`` of its
    row of a :func:`layer_offsets` table; ALIGNED: the table's offsets keep 16 bytes."""
    offset = tl.load(row + column)
    if ALIGNED:
        offset = tl.multiple_of(offset, 16 // (base.dtype.element_ty.primitive_bitwidth // 8))
    return base + offset


def dot_block(n: int) -> int:
    """Block side covering ``n``: a power of two, at least 16 (``tl.dot``'s minimum)."""
    return max(16, triton.next_power_of_2(n))


@triton.jit
def bit_is_set(words, bits):
    """Bit ``bits % 64`` of each int64 in ``words``, as bool: the ancestor test on
    ``TreeMetadata.ancestor_words``, whose word ``j // 64`` holds node ``j``."""
    return ((words >> tl.cast(bits % 64, tl.int64)) & 1) != 0
