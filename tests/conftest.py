import os
import sys
from pathlib import Path

# Triton kernels run on CPU tensors only through the interpreter.
os.environ.setdefault("TRITON_INTERPRET", "1")
# Command-line tools (tiny model family, benchmarks) are importable by tests.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
