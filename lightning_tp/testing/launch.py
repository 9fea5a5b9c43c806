"""``run_local(world, fn, *args)``: fn(rank, world, *args) on world local processes with torchrun's
environment (RANK, LOCAL_RANK, WORLD_SIZE), so Lightning inside starts no launcher; they fork from one
server that imported torch and lightning once (a launch costs ~0.1 s, not an import per process)."""

from __future__ import annotations

import datetime
import gc
import multiprocessing
import os
import socket
import tempfile
import time
import traceback

import torch
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

PRELOAD = ["torch", "lightning", "lightning_tp", "transformers"]  # a module not installed is skipped


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, outdir, env, fn, args):
    gc.freeze()  # what the server imported is never garbage: the collector leaves it alone (~10% of a short fit's CPU)
    os.environ.clear()  # the caller's environment at launch, not the one the server started with
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                      LOCAL_RANK=str(rank), NODE_RANK="0", PL_DISABLE_FORK="1")
    torch.set_num_threads(1)
    try:
        result = fn(rank, world, *args)
        torch.save({"ok": result}, os.path.join(outdir, f"{rank}.pt"))
    except BaseException:
        torch.save({"error": traceback.format_exc()}, os.path.join(outdir, f"{rank}.pt"))
        raise


def start_local(world: int, fn, outdir: str, *args, preload=()):
    """Start fn(rank, world, *args) on world processes and return without waiting; rank r's result (or
    traceback) is written to ``outdir/{r}.pt``. LIGHTNING_TP_LOCAL_START=fork forks them from this process."""
    multiprocessing.set_forkserver_preload(PRELOAD + list(preload))  # read at the server's start only
    method = os.environ.get("LIGHTNING_TP_LOCAL_START", "forkserver")
    return mp.start_processes(_worker, args=(world, free_port(), outdir, dict(os.environ), fn, args),
                              nprocs=world, join=False, start_method=method)


def load_result(path):
    """A worker's ``{rank}.pt``: tensors, numbers, strings, containers, timedeltas and pipeline Action records."""
    from ..pipeline.schedule.schedules import Action

    with torch.serialization.safe_globals([Action, datetime.timedelta]):
        return torch.load(path, weights_only=True)


def run_local(world: int, fn, *args, timeout: float = 600.0, preload=()) -> list:
    """fn(rank, world, *args) on every rank; returns the per-rank results, raises a worker's traceback. A launch
    whose port was taken between free_port() and the store's bind (EADDRINUSE) is started again on another."""
    for attempt in range(3):
        try:
            return _run_once(world, fn, args, timeout, preload)
        except RuntimeError as e:
            if "EADDRINUSE" not in str(e) or attempt == 2:
                raise


def _run_once(world: int, fn, args, timeout: float, preload) -> list:
    with tempfile.TemporaryDirectory() as outdir:
        ctx = start_local(world, fn, outdir, *args, preload=preload)
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
            try:
                out = load_result(path)
            except Exception as e:  # noqa: BLE001 - a result weights_only cannot read, named with its rank
                errors.append(f"rank {rank} returned what torch.load(weights_only=True) cannot read: {e}")
                continue
            if "error" in out:
                errors.append(f"rank {rank} failed:\n{out['error']}")
            else:
                results.append(out["ok"])
        if errors:  # the first cause first: a rank that lost its peer only reports "connection closed"
            errors.sort(key=lambda e: "Connection closed" in e)
            raise RuntimeError("\n".join(errors))
        return results
