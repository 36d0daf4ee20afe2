"""How many launches a call makes: on a GPU, where work runs outside a CUDA graph, each is
a few microseconds of host time, which is why eager paths (model runner V2's verification)
are kept to few of them.

Counted: torch calls that make a tensor of their own (a view launches nothing, nor does an
uninitialised allocation) and Triton kernel launches. What the Triton interpreter runs inside
a launch on CPU is not counted, so the count on CPU is the count a GPU would see.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Allocations without a kernel.
NO_KERNEL = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_like.default,
             torch.ops.aten.empty_strided.default}


class LaunchCount(TorchDispatchMode):
    """``with LaunchCount() as count: ...`` then ``count.calls``."""

    def __init__(self):
        super().__init__()
        self.calls = 0
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        launching = func not in NO_KERNEL and not any(ret.alias_info for ret in func._schema.returns)
        self.calls += launching and not self.paused
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction

        self._patched = [(cls, cls.run) for cls in (JITFunction, InterpretedFunction)]
        for cls, run in self._patched:
            cls.run = self._counted(run)
        return super().__enter__()

    def __exit__(self, *exc):
        for cls, run in self._patched:
            cls.run = run
        return super().__exit__(*exc)

    def _counted(self, run):
        def launch(*args, **kwargs):
            self.paused = True
            try:
                return run(*args, **kwargs)
            finally:
                self.paused = False
                self.calls += not kwargs.get("warmup", False)
        return launch


def launches(fn) -> int:
    """Launches one call of ``fn()`` makes."""
    with LaunchCount() as count:
        fn()
    return count.calls
