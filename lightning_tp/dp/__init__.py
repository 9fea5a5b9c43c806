"""Data parallelism: gradient bookkeeping and averaging (grads.py), the all-reduce overlapped with the
backward (overlap.py), and the optimizer state or parameters sharded over dp (zero/)."""
