"""Data parallelism: one owner of the gradients' way across dp (sync.py: zero=0, 1 or 3), their bookkeeping
and averaging (grads.py), the all-reduce overlapped with the backward (overlap.py), and the optimizer state
or parameters sharded over dp (zero/)."""
