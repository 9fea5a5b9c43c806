"""Run a measurement on this machine's local processes, each in a gloo group of them all, as a run's ranks are;
for calibrate() and timed plans."""

from __future__ import annotations

import os
import queue
import socket
import traceback


def _worker(rank: int, world: int, port: int, threads: int, out, fn, args) -> None:
    import torch
    import torch.distributed as dist

    try:  # as torchrun's: Lightning inside starts no launcher of its own
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                          LOCAL_RANK=str(rank), NODE_RANK="0")
        torch.set_num_threads(threads)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        result = fn(rank, world, *args)
        dist.destroy_process_group()
        out.put((rank, "ok", result if rank == 0 else None))
    except BaseException:
        out.put((rank, "error", traceback.format_exc()))


def on_local_processes(world: int, fn, *args, threads: int = 1, timeout: float = 900.0):
    """``fn(rank, world, *args)`` on ``world`` spawned processes of ``threads`` threads in one gloo group;
    rank 0's result (``fn`` and its arguments must pickle). Raises with a failing rank's traceback."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, world, port, threads, out, fn, args)) for r in range(world)]
    for p in procs:
        p.start()
    result, errors = None, []
    try:
        for _ in range(world):
            rank, status, value = out.get(timeout=timeout)
            if status == "error":
                errors.append(f"rank {rank}:\n{value}")
                break  # the others may wait on it in a collective: they are stopped below
            if rank == 0:
                result = value
    except queue.Empty:
        errors.append(f"no result within {timeout} s")
    finally:
        for p in procs:
            p.join(timeout=0 if errors else 60)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("a measurement on local processes failed: " + "\n".join(errors))
    return result
