import os
import zlib

import pytest
import torch

# Triton kernels run on CPU tensors only through the interpreter.
os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def gen(request) -> torch.Generator:
    """A torch.Generator seeded from the test's node id: the same draws on every run,
    different ones per test and parameter. The seed is printed, so a failing test's
    report shows it ("Captured stdout setup") and a script can replay its inputs."""
    seed = zlib.crc32(request.node.nodeid.encode())
    print(f"seed {seed} for {request.node.nodeid}")
    return torch.Generator().manual_seed(seed)
