"""The tests' launches: lightning_tp.testing's local processes (forked from one server that imported
torch, lightning and the tests' shared modules once), and the ending of torchrun agents."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from lightning_tp.testing import free_port, load_result
from lightning_tp.testing import run_local, start_local

PRELOAD = ("helpers", "models")


def run(world: int, fn, *args, timeout: float = 600.0) -> list:
    """fn(rank, world, *args) on every rank; returns the per-rank results, raises a worker's traceback."""
    return run_local(world, fn, *args, timeout=timeout, preload=PRELOAD)


def start(world: int, fn, outdir: str, *args):
    """fn(rank, world, *args) on world processes, not waited for; each writes {rank}.pt to outdir."""
    return start_local(world, fn, outdir, *args, preload=PRELOAD)


result = load_result
__all__ = ["free_port", "run", "start", "result"]


def torchrun() -> list:
    """The command of a torchrun whose workers fork from a preloaded server (tests/torchrun_preloaded.py)."""
    here = os.path.dirname(os.path.abspath(__file__))
    return [sys.executable, os.path.join(here, "torchrun_preloaded.py"), "--run-path", "--start-method", "forkserver"]


def descendants(pid: int) -> list:
    """The processes under pid (Linux /proc): torchrun starts each worker under setsid (detached from its agent), so
    killing an agent's process group would leave its workers running."""
    found = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                found += [int(c) for c in f.read().split()]
    except OSError:
        return []
    return found + [d for c in found for d in descendants(c)]


def stop_agents(agents):
    """End the agents still running and their workers: SIGTERM, which an agent passes on to its workers,
    then SIGKILL to whichever of them is left after a few seconds."""
    running = [a for a in agents if a.poll() is None]
    pids = [p for a in running for p in descendants(a.pid)]
    for a in running:
        a.terminate()
    for a in running:
        try:
            a.wait(timeout=10)
        except subprocess.TimeoutExpired:
            a.kill()
            a.wait()
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
