"""``no_host_reads()``: the plugin's code may not read a tensor's values on the host.

On CUDA every such read (``.item()``, ``bool(t)``, ``.tolist()``, ``.cpu()``, a boolean
mask index, ``nonzero``, one-argument ``torch.where``, ``repeat_interleave`` of tensor
repeats without ``output_size``, ...) waits for the device to finish all queued work, and
inside a CUDA graph capture it fails. The tests run on CPU tensors, where those reads are
free and look harmless: patched to raise while the context is active, the same calls show
where a GPU step would stall.

Only calls made from the plugin's own modules (``vllm_tfm``, ``triton_ops``) raise: vLLM's
code and the libraries' internals (Triton's interpreter reads its CPU tensors) are not
what these tests check.
"""

from __future__ import annotations

import contextlib
import sys
from unittest import mock

import torch

CHECKED_MODULES = ("vllm_tfm", "triton_ops")

# Reads of a tensor's values: each returns host data, or sizes an output by the data.
_READING_METHODS = (
    "__bool__", "__int__", "__float__", "__index__", "__array__", "item", "tolist", "cpu",
    "numpy", "nonzero", "argwhere", "masked_select", "unique", "bincount",
)
_READING_FUNCTIONS = ("nonzero", "argwhere", "masked_select", "unique", "bincount")


class HostRead(AssertionError):
    """A tensor's values were read on the host inside ``no_host_reads``."""


def _called_from_plugin() -> bool:
    # Frame 0: this function; 1: the patched wrapper; 2: its caller.
    caller = sys._getframe(2).f_globals.get("__name__", "")
    return caller.split(".")[0] in CHECKED_MODULES


def _guarded(original, name: str, reads):
    """``original``, raising HostRead where ``reads(args, kwargs)`` and the caller is ours."""

    def call(*args, **kwargs):
        if _called_from_plugin() and reads(args, kwargs):
            raise HostRead(f"{name} reads tensor values on the host (a device sync on CUDA)")
        return original(*args, **kwargs)

    return call


def _always(args, kwargs) -> bool:
    return True


def _mask_index(args, kwargs) -> bool:
    """``tensor[index]`` / ``tensor[index] = value`` with a boolean tensor in the index."""
    index = args[1]
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(part, torch.Tensor) and part.dtype == torch.bool for part in parts)


def _one_argument_where(args, kwargs) -> bool:
    return len(args) + len(kwargs) == 1


def _repeats_without_output_size(args, kwargs) -> bool:
    repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
    return isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None


@contextlib.contextmanager
def no_host_reads():
    """Raise HostRead at any host read of tensor values made by the plugin's code."""
    patches = [(torch.Tensor, name, _always) for name in _READING_METHODS]
    patches += [(torch, name, _always) for name in _READING_FUNCTIONS]
    patches += [(torch.Tensor, "__getitem__", _mask_index),
                (torch.Tensor, "__setitem__", _mask_index),
                (torch, "where", _one_argument_where),
                (torch.Tensor, "repeat_interleave", _repeats_without_output_size),
                (torch, "repeat_interleave", _repeats_without_output_size)]
    with contextlib.ExitStack() as stack:
        for owner, name, reads in patches:
            original = getattr(owner, name)
            stack.enter_context(mock.patch.object(
                owner, name, _guarded(original, f"{owner.__name__}.{name}", reads)))
        yield


def run_as_on_cuda(monkeypatch) -> None:
    """Make the plugin's Triton ops take their CUDA path on CPU tensors: the kernels (in
    Triton's interpreter) instead of the PyTorch fallbacks, which may read the host off
    CUDA, and none of the value checks that CUDA skips (``triton_ops.utils.host_readable``)."""
    from triton_ops.utils import host_readable, use_triton

    for name, module in list(sys.modules.items()):
        if name.split(".")[0] != "triton_ops":
            continue
        if getattr(module, "use_triton", None) is use_triton:
            monkeypatch.setattr(module, "use_triton", lambda backend, like: backend != "torch")
        if getattr(module, "host_readable", None) is host_readable:
            monkeypatch.setattr(module, "host_readable", lambda tensor: False)
