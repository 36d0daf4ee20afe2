import os
import sys
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


@pytest.fixture(autouse=True, scope="module")
def fla_visible_to_each_module():
    """Loading a CPU target hides fla for the whole process (training.target.hide_fla); a
    module that did so must not take fla from the modules after it (test_gdn_tree's
    chains against fla's kernels)."""
    before = sys.modules.get("fla", 0)
    yield
    if sys.modules.get("fla", 0) is None and before is not None:
        if before == 0:
            del sys.modules["fla"]
        else:
            sys.modules["fla"] = before
