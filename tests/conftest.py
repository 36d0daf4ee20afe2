import os
import sys
import zlib
from pathlib import Path

import pytest
import torch

# Triton kernels run on CPU tensors only through the interpreter.
os.environ.setdefault("TRITON_INTERPRET", "1")
# Command-line tools (tiny model family, benchmarks) are importable by tests.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))


@pytest.fixture
def gen(request) -> torch.Generator:
    """A torch.Generator seeded from the test's node id: the same draws on every run,
    different ones per test and parameter. The seed is printed, so a failing test's
    report shows it ("Captured stdout setup") and a script can replay its inputs."""
    seed = zlib.crc32(request.node.nodeid.encode())
    print(f"seed {seed} for {request.node.nodeid}")
    return torch.Generator().manual_seed(seed)
