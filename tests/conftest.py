import os

# Triton kernels run on CPU tensors only through the interpreter.
os.environ.setdefault("TRITON_INTERPRET", "1")
