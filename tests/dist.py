"""Run a function on N local processes that look like torchrun's (RANK, LOCAL_RANK, WORLD_SIZE set),
so Lightning inside them starts no launcher of its own. One launch should run many checks: starting
a gloo group costs seconds on CPU."""

from __future__ import annotations

import os
import signal
import subprocess
import socket
import tempfile
import time
import traceback

import torch
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, outdir, fn, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                      LOCAL_RANK=str(rank), NODE_RANK="0", PL_DISABLE_FORK="1")
    torch.set_num_threads(1)
    try:
        result = fn(rank, world, *args)
        torch.save({"ok": result}, os.path.join(outdir, f"{rank}.pt"))
    except BaseException:
        torch.save({"error": traceback.format_exc()}, os.path.join(outdir, f"{rank}.pt"))
        raise


def run(world: int, fn, *args, timeout: float = 600.0) -> list:
    """fn(rank, world, *args) on every rank; returns the per-rank results, raises a worker's traceback."""
    with tempfile.TemporaryDirectory() as outdir:
        ctx = mp.start_processes(_worker, args=(world, free_port(), outdir, fn, args), nprocs=world, join=False,
                                 start_method="spawn")
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"workers did not finish within {timeout} s")
        except ProcessException:  # a rank died: its saved traceback is reported below
            pass
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        results, errors = [], []
        for rank in range(world):
            path = os.path.join(outdir, f"{rank}.pt")
            if not os.path.exists(path):
                errors.append(f"rank {rank} exited without a result (exit code {ctx.processes[rank].exitcode})")
                continue
            out = torch.load(path, weights_only=False)
            if "error" in out:
                errors.append(f"rank {rank} failed:\n{out['error']}")
            else:
                results.append(out["ok"])
        if errors:  # the first cause first: a rank that lost its peer only reports "connection closed"
            errors.sort(key=lambda e: "Connection closed" in e)
            raise RuntimeError("\n".join(errors))
        return results


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
