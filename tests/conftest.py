import os
import sys

# Triton reads this once, at its first import (lightning imports triton): the kernel tests run the
# Triton kernels on CPU tensors in the interpreter. Dispatch elsewhere stays on the torch path.
os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (ROOT, os.path.join(ROOT, "tests")):
    if p not in sys.path:
        sys.path.insert(0, p)
