"""Helpers for parity tests and benchmarks of your own: run a function on N local processes shaped as
torchrun's ranks (:func:`run_local`). See docs/testing.md."""

from .launch import free_port, load_result, run_local, start_local

__all__ = ["free_port", "load_result", "run_local", "start_local"]
