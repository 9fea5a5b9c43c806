"""``calibrate()``: this machine as a Cluster, measured: the matrix-product rate and its curve over GEMM
sizes, the memory bandwidth, and gloo's all-reduce latency and bandwidth between local processes, each
process using the threads MegaStrategy would give it. See docs/planner.md."""

from __future__ import annotations

import os
import time

import torch

from .cluster import Cluster
from .local import on_local_processes

SIZES = (32, 64, 128, 256, 512)  # GEMM widths: (1024 x n) @ (n x n)


def _times(fn, repeat: int) -> list:
    """Seconds of ``repeat`` calls of ``fn`` after one warm-up."""
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times


def _best(fn, repeat: int = 7) -> float:
    return min(_times(fn, repeat))


def _mean(fn, repeat: int = 15) -> float:
    """The mean of ``repeat`` calls: what a step's many calls add up to, waits for a late peer included."""
    return sum(_times(fn, repeat)) / repeat


def _median(fn, repeat: int = 15) -> float:
    times = sorted(_times(fn, repeat))
    return times[len(times) // 2]


def gemm_curve(threads: int) -> tuple:
    """(peak GFLOP/s, GFLOP at half of it) of fp32 products on ``threads`` threads: the rate of the largest
    size, and the half point that fits the smallest."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        rates = {}
        for n in SIZES:
            a, b = torch.randn(1024, n), torch.randn(n, n)
            rates[2 * 1024 * n * n / 1e9] = 2 * 1024 * n * n / _best(lambda: a @ b) / 1e9
        big = sorted(rates)
        peak = max(rates.values())
        small = big[0]
        return peak, small * max(peak / rates[small] - 1, 0.0)
    finally:
        torch.set_num_threads(before)


def stream_gbps(threads: int) -> float:
    """Memory bandwidth (Gbit/s) of an elementwise product over 4 MiB (an activation's size here), read and
    written into a new tensor, as a training step's elementwise kernels do."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = torch.randn(2 ** 20)
        return 2 * x.numel() * 4 * 8 / _best(lambda: x * 1.0001) / 1e9
    finally:
        torch.set_num_threads(before)


SIZES_BYTES = (256, 2 ** 20, 4 * 2 ** 20, 16 * 2 ** 20)


def _gloo_worker(rank: int, world: int) -> dict:
    import torch.distributed as dist

    results = {"slowdown": _slowdown_here(rank, world, dist.barrier)}
    dist.barrier()  # every process steps AdamW at once, as dp replicas do: they share the memory bandwidth
    results["adamw"] = adamw_seconds_per_param(1)
    for n in SIZES_BYTES:  # the whole tensor's bytes
        whole, part = torch.ones(n // 4), torch.ones(n // 4 // world)
        results["all_reduce", n] = _best(lambda: dist.all_reduce(whole), repeat=9)
        results["reduce_scatter", n] = _best(lambda: dist.reduce_scatter_tensor(part, whole), repeat=9)
        results["all_gather", n] = _best(lambda: dist.all_gather_into_tensor(whole, part), repeat=9)
    _strategy_ops(results, world)
    results["loop"] = loop_overheads(devices=world)
    results["overlap"] = _overlap_here()
    return results


def _overlap_here(rounds: int = 3) -> float:
    """The share of a 16 MiB all-reduce that compute started after it hides (as a backward hides a bucket's),
    from the times alone and together: the median of ``rounds``."""
    import torch.distributed as dist

    a, w, flat = torch.randn(1024, 256), torch.randn(256, 256), torch.ones(4 * 2 ** 20)

    def compute():
        for _ in range(24):
            a @ w

    def both():
        work = dist.all_reduce(flat, async_op=True)
        compute()
        work.wait()
    shares = []
    for _ in range(rounds):
        alone, reduce, together = _mean(compute, 5), _mean(lambda: dist.all_reduce(flat), 5), _mean(both, 5)
        shares.append(min(max((alone + reduce - together) / reduce, 0.0), 1.0))
    return sorted(shares)[len(shares) // 2]


def _workload() -> float:
    """Seconds of one run of a transformer block's kind of work (products, GELU, a norm)."""
    a, w = torch.randn(512, 256), torch.randn(256, 1024)
    t = time.perf_counter()
    for _ in range(4):
        h = torch.nn.functional.gelu(a @ w)
        torch.nn.functional.layer_norm(h @ w.t(), (256,))
    return time.perf_counter() - t


def _slowdown_here(rank: int, world: int, barrier) -> float:
    """Rounds of: each process running the workload alone in turn, then all at once; the medians' ratio."""
    alone, together = [], []
    for _ in range(7):
        for r in range(world):
            barrier()
            if r == rank:
                alone.append(_workload())
        barrier()
        together.append(_workload())
    return sorted(together)[len(together) // 2] / sorted(alone)[len(alone) // 2]


def slowdown(world: int) -> float:
    """How much slower a process computes while ``world`` local processes all compute (shared caches and
    memory), as :func:`gloo_ops`'s workers last measured it (1 for one process)."""
    return max(1.0, _measured.get(world, {}).get("slowdown", 1.0))


_measured = {}  # world -> what gloo_ops's workers measured beside the collectives (slowdown, adamw, loop, overlap)


def adamw_seconds_per_param(threads: int, numel: int = 2 ** 21, tensors: int = 48) -> float:
    """Seconds per parameter of a torch AdamW step over ``tensors`` parameters of ``numel`` elements in all (a
    model's dozens of weights), on ``threads`` threads; the median of runs (see :func:`adamw_step_seconds`)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return adamw_step_seconds([torch.nn.Parameter(torch.randn(numel // tensors)) for _ in range(tensors)])
    finally:
        torch.set_num_threads(before)


def adamw_step_seconds(params) -> float:
    """Seconds per parameter of a torch AdamW step (its default implementation here) over ``params``, given
    random gradients: the median of 7 steps after one."""
    params = list(params)
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params)
    return _median(opt.step, repeat=7) / sum(p.numel() for p in params)


TP_SIZES_BYTES = (2 ** 18, 2 ** 20, 4 * 2 ** 20)
DP_SIZES_BYTES = (2 ** 20, 4 * 2 ** 20, 8 * 2 ** 20, 16 * 2 ** 20)


def _strategy_ops(results: dict, world: int) -> None:
    """tp's collectives as the parallel layers run them on (batch, sequence, hidden) activations, and dp's
    gradient all-reduce, each after some compute (the mean, less the compute's)."""
    from .. import comm
    from ..dp.grads import settle, start_all_reduce
    import torch.distributed as dist

    group = dist.group.WORLD
    a, w = torch.randn(256, 256), torch.randn(256, 256)

    def between(op):  # each call after some compute, as in a forward: the ranks arrive apart, as they do there
        def run():
            for _ in range(8):
                a @ w
            op()
        return run
    grads = {n: [torch.ones(n // 4 // 12) for _ in range(12)] for n in DP_SIZES_BYTES}  # dp's: a dozen of them
    rounds = {}  # their times have a long tail and slow spells: the median of rounds' means
    for _ in range(3):
        compute = _mean(between(lambda: None), repeat=20)
        for n in TP_SIZES_BYTES:
            x = torch.ones(4, n // 4 // (4 * 64), 64)
            part = torch.ones(4, x.shape[1] // world, 64)
            for name, op in (("tp_all_reduce", lambda: comm.all_reduce(x.clone(), group)),
                             ("sp_reduce_scatter", lambda: comm.reduce_scatter(x, 1, group)),
                             ("sp_all_gather", lambda: comm.all_gather(part, 1, group))):
                rounds.setdefault((name, n), []).append(max(_mean(between(op), repeat=20) - compute, 1e-6))
        for n, bucket in grads.items():  # as the strategy runs it: flattened into a new bucket, summed, averaged
            op = lambda: settle([start_all_reduce(bucket, group)], 0.5)  # noqa: E731  (and copied back)
            rounds.setdefault(("dp_all_reduce", n), []).append(max(_mean(between(op), repeat=5) - compute, 1e-6))
    results.update({key: sorted(times)[1] for key, times in rounds.items()})


def gloo_ops(world: int = 2) -> tuple:
    """(op, Gbit/s, latency s) of gloo's all-reduce, reduce-scatter and all-gather between ``world`` local
    processes (and tp's and dp's as the strategy calls them: tp_/sp_/dp_), each fitted to a ring's steps."""
    results = on_local_processes(world, _gloo_worker, threads=max(1, (os.cpu_count() or 1) // world))
    _measured[world] = {key: results.pop(key) for key in ("slowdown", "adamw", "loop", "overlap")}
    fitted = []
    for op in ("all_reduce", "reduce_scatter", "all_gather", "tp_all_reduce", "sp_reduce_scatter", "sp_all_gather",
               "dp_all_reduce"):
        steps = 2 * (world - 1) if op.endswith("all_reduce") else world - 1
        sizes = TP_SIZES_BYTES if op.startswith(("tp_", "sp_")) else DP_SIZES_BYTES if op.startswith("dp_") \
            else SIZES_BYTES
        xs = [n * steps / world for n in sizes]  # bytes each rank sends, in all
        ys = [results[op, n] for n in sizes]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        per_byte = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)  # least squares
        fitted.append((op, 8 / max(per_byte, 1e-15) / 1e9, max(my - per_byte * mx, 0.0) / steps))
    _, gbps, latency = fitted[-1]  # zero=1's reduce-scatter on gloo is an all-reduce of its bucket in place (see
    fitted.append(("dp_reduce_scatter", gbps / 2, latency * 2))  # zero.shards): dp's, over a ring's half the steps
    return tuple(fitted)


class _Tiny(torch.nn.Module):
    def __init__(self, blocks: int):
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(blocks)])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def step_times():
    """A Lightning callback noting each training batch's wall time (``.times``, seconds)."""
    import lightning as L

    class StepTimes(L.Callback):
        def __init__(self):
            self.times = []

        def on_train_batch_start(self, *args):
            self.start = time.perf_counter()

        def on_train_batch_end(self, *args):
            self.times.append(time.perf_counter() - self.start)

    return StepTimes()


def loop_overheads(steps: int = 30, devices: int = 1) -> tuple:
    """(seconds per optimizer step, per pipeline action) the training loop itself takes here: Lightning fits of a
    tiny module logging its loss on ``devices`` local processes, plain, and with microbatches (a pipeline over them)."""
    import lightning as L
    import torch.distributed as dist

    from ..strategy import MegaStrategy

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _Tiny(max(2, devices))

        def training_step(self, batch, batch_idx):
            loss = self.net(batch).pow(2).mean()
            self.log("loss", loss, sync_dist=True)  # as most modules log their loss
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters())

    started, environ = dist.is_initialized(), dict(os.environ)

    def fit(m: int, pp: int) -> float:  # the median step after warm-up
        times = step_times()
        trainer = L.Trainer(accelerator="cpu", devices=devices, max_steps=steps, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, callbacks=[times],
                            strategy=MegaStrategy(pp=pp, microbatches=m, pipeline_blocks="net.blocks"))
        trainer.fit(Tiny(), torch.utils.data.DataLoader(torch.randn(steps * 8 * devices, 8), batch_size=8))
        return sorted(times.times[5:])[len(times.times[5:]) // 2]

    step = fit(1, 1)
    if devices > 1:  # a pipeline over all the processes: 8 more actions a rank, each with its sends and receives
        action = max(fit(8, devices) - fit(4, devices), 0.0) / 8
    else:  # 4 microbatches: 6 more actions
        action = max(fit(4, 1) - step, 0.0) / 6
    if not started and dist.is_initialized():  # the one-process group MegaStrategy made: not the caller's
        dist.destroy_process_group()
    os.environ.clear()  # Lightning's fit set OMP_NUM_THREADS, MASTER_PORT, ...: processes started later
    os.environ.update(environ)  # would inherit them
    return step, action


def calibrate(world: int = 2, threads: int | None = None) -> Cluster:
    """This machine as a Cluster of ``world`` local processes (threads each: cores // world, as MegaStrategy
    sets them), its rates measured now (seconds)."""
    threads = threads or max(1, (os.cpu_count() or 1) // world)
    peak, half = gemm_curve(threads)
    ops = gloo_ops(world) if world > 1 else ()
    gbps, latency = (ops[0][1], ops[0][2]) if ops else (1e6, 0.0)
    measured = _measured.get(world, {})
    step, action = measured.get("loop") or loop_overheads()
    return Cluster(gpus=world, gpus_per_node=world, gpu_memory_gib=1e6, peak_tflops=peak / 1e3,
                   intra_node_gbps=gbps, inter_node_gbps=gbps, hbm_gbps=stream_gbps(threads),
                   gemm_efficiency=1.0, gemm_half_gflop=max(half, 1e-6), latency_us=latency * 1e6,
                   intra_latency_us=latency * 1e6, ops=ops, step_overhead_s=step, action_overhead_s=action,
                   compute_slowdown=slowdown(world), comm_overlap=measured.get("overlap", 1.0),
                   optimizer_s_per_param=measured.get("adamw") or adamw_seconds_per_param(threads))
