"""Worker side of bench/pipeline.py: a block model with fixed simulated cost, our executor inside a
real Lightning Trainer, torch.distributed.pipelining on the same blocks, and small overhead probes.

Everything here runs inside the 4 processes that ``lightning_tp.testing.run_local`` starts; it returns raw
timestamps and counters, and bench/pipeline.py turns them into the tables.
"""

from __future__ import annotations

import logging
import statistics
import time
import warnings

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

ROWS, WIDTH = 64, 256  # one microbatch's activation: 64 x 256 fp32 = 64 KiB per block


# ------------------------------------------------------------------------------ per-process counters


class Stats:
    """Counters of this process, reset at every step start."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.inflight = self.inflight_peak = 0  # bytes saved by F whose first backward has not run yet
        self.resident = self.resident_peak = 0  # bytes whose autograd node (ctx) is still alive
        self.sleep = 0.0  # seconds slept in F/B (the simulated compute)
        self.n_f = self.n_b = 0  # block forward / backward calls
        # seconds inside our executor: whole train_step, Mailbox.send/recv/wait, _publish (log broadcast)
        self.train_step = self.send = self.recv = self.wait = self.publish = 0.0
        self.arrival_waits = 0.0  # of recv: the receives' waits (an activation's made inside an F, at its first block)
        self.mailbox_peak = 0  # bytes of sent tensors our Mailbox still holds (it releases them at step end)
        self.act = {"F": 0.0, "B": 0.0, "Bs": 0.0, "W": 0.0}  # seconds in our F / B / split B / W (no P2P)
        self.first_work, self.last_work = None, 0.0  # start of the step's first block cost, end of its last
        self.holds = []  # (start, end, "F" or "B") of each simulated cost: a block's forward from its entry, a backward half
        self.acts = {"F": 0, "B": 0, "Bs": 0, "W": 0}

    def add(self, n):
        self.inflight += n
        self.inflight_peak = max(self.inflight_peak, self.inflight)


STATS = Stats()


class _Saved:
    """What a saved-tensors pack hook keeps for a saved activation: counts its bytes until autograd
    releases it (after a backward without retain_graph, or when the graph is dropped). This is the
    true residency, e.g. ZB keeps the graph, and so the activations, from B until W."""

    def __init__(self, t):
        self.t, self.n = t, (t.numel() * t.element_size() if t.dim() == 2 else 0)  # the weight: not counted
        STATS.resident += self.n
        STATS.resident_peak = max(STATS.resident_peak, STATS.resident)

    def __del__(self):
        STATS.resident -= self.n


SPIN = 0.0003  # seconds spun (not slept) at the end of each simulated cost: see _hold


def _hold(t, start=None, kind=None):
    """Take exactly ``t`` seconds counted from ``start`` (default: now), so that a block's own real work
    (its multiply, autograd's bookkeeping) is part of its simulated cost instead of added to it. Sleeps
    most of it and spins the last 0.3 ms: a plain sleep on this VM overshoots by 0.15-0.35 ms (and a
    sleep(0) costs ~0.08 ms), which made the model itself run ~6% over the schedule's nominal cost
    (measured: 3.8 ms per 60 ms forward+backward of a stage), the same for our executor and torch's."""
    if t <= 0:
        return
    kind = kind or ("B" if start is None else "F")
    t0 = time.perf_counter()
    deadline = (t0 if start is None else start) + t
    if deadline - t0 > SPIN:
        time.sleep(deadline - t0 - SPIN)
    while time.perf_counter() < deadline:
        pass
    STATS.last_work = time.perf_counter()
    STATS.sleep += STATS.last_work - t0
    STATS.holds.append((t0 if start is None else start, STATS.last_work, kind))
    if STATS.first_work is None:
        STATS.first_work = deadline - t


class SleepCost(torch.autograd.Function):
    """Identity with a simulated cost: forward takes tf (counted from ``start``, the block's entry),
    backward takes tb. ``nbytes`` > 0 marks a block's input-path half: its forward starts a saved
    activation's life, its first backward ends it (the live-activation count) and it counts the
    block's forward/backward calls."""

    @staticmethod
    def forward(ctx, x, tf, tb, nbytes, start=None):
        _hold(tf, start)
        ctx.tb, ctx.nbytes, ctx.pending = tb, nbytes, nbytes > 0
        if nbytes:
            STATS.n_f += 1
            STATS.add(nbytes)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        _hold(ctx.tb)
        if ctx.nbytes:
            STATS.n_b += 1
            if ctx.pending:
                STATS.inflight -= ctx.nbytes
                ctx.pending = False
        return g, None, None, None, None


class SleepBlock(nn.Module):
    """y = x * w with a fixed simulated cost, split like a real layer's backward: the input-gradient
    half (tb / 2, on the path to the block's input) and the weight-gradient half (tb / 2, on the
    weight's own branch). A plain backward pays both; zero-bubble's B pays the first and W the
    second (rank 0, whose stage has no input gradient, pays both in W)."""

    def __init__(self, tf, tb, width=WIDTH):
        super().__init__()
        self.tf, self.tb = tf, tb
        self.w = nn.Parameter(torch.ones(width))

    def forward(self, x):
        start = time.perf_counter()
        w = SleepCost.apply(self.w, 0.0, self.tb / 2, 0)
        with torch.autograd.graph.saved_tensors_hooks(_Saved, lambda saved: saved.t):
            y = x * w
        return SleepCost.apply(y, self.tf, self.tb / 2, x.numel() * x.element_size(), start)


class FusedSleepMul(torch.autograd.Function):
    """y = x * w as ONE autograd node whose backward returns the input's and the weight's gradients
    together, as a fused kernel's does (flash attention, fused MLP/norm kernels, Triton ops, QAT
    layers): forward takes tf counted from ``start`` (the block's entry), backward tb for both
    gradients. There is no separate weight branch, so a split backward's W cannot take only the
    weight half: it re-runs this whole backward (B already ran it for the input gradient)."""

    @staticmethod
    def forward(ctx, x, w, tf, tb, start):
        y = x * w
        ctx.save_for_backward(x, w)
        ctx.tb, ctx.nbytes, ctx.pending = tb, x.numel() * x.element_size(), True
        _hold(tf, start)
        STATS.n_f += 1
        STATS.add(ctx.nbytes)
        return y

    @staticmethod
    def backward(ctx, g):
        t0 = time.perf_counter()
        x, w = ctx.saved_tensors
        gx = g * w if ctx.needs_input_grad[0] else None
        gw = (g * x).sum(0)  # both gradients in one call, whatever the caller asked for
        _hold(ctx.tb, t0, "B")  # the real work above is part of tb
        STATS.n_b += 1
        if ctx.pending:
            STATS.inflight -= ctx.nbytes
            ctx.pending = False
        return gx, gw, None, None, None


class FusedBlock(nn.Module):
    """SleepBlock's y = x * w and costs (tf forward, tb backward), its backward one fused node (see
    FusedSleepMul) instead of an input half and a weight half."""

    def __init__(self, tf, tb, width=WIDTH):
        super().__init__()
        self.tf, self.tb = tf, tb
        self.w = nn.Parameter(torch.ones(width))

    def forward(self, x):
        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(_Saved, lambda saved: saved.t):
            return FusedSleepMul.apply(x, self.w, self.tf, self.tb, start)


BLOCKS = {"split": SleepBlock, "fused": FusedBlock}  # bench/pipeline.py --blocks
BLOCK = SleepBlock  # this process's block class: worker() sets it from the plan's ``blocks``


class SleepNet(L.LightningModule):
    """An ordinary LightningModule: a block list and an MSE loss."""

    def __init__(self, n_blocks, tf, tb):
        super().__init__()
        self.blocks = nn.ModuleList(BLOCK(tf, tb) for _ in range(n_blocks))

    def training_step(self, batch, batch_idx):
        x, y = batch
        for b in self.blocks:
            x = b(x)
        loss = F.mse_loss(x, y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


class Batches(torch.utils.data.Dataset):
    """Whole batches (no per-sample collation in the timed loop)."""

    def __init__(self, n, m):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(m * ROWS, WIDTH, generator=g)
        self.y = torch.zeros_like(self.x)
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return self.x, self.y


# ------------------------------------------------------------------------------ timing


class Recorder:
    def __init__(self):
        self.start, self.end, self.stats = [], [], []

    def begin(self):
        STATS.reset()
        self.start.append(time.perf_counter())

    def finish(self):
        self.end.append(time.perf_counter())
        s = STATS
        self.stats.append(dict(inflight_peak=s.inflight_peak, resident_peak=s.resident_peak, sleep=s.sleep,
                               n_f=s.n_f, n_b=s.n_b, train_step=s.train_step, send=s.send, recv=s.recv,
                               wait=s.wait, publish=s.publish, mailbox_peak=s.mailbox_peak,
                               leftover=s.inflight, act=dict(s.act), acts=dict(s.acts), first_work=s.first_work,
                               last_work=s.last_work, holds=list(s.holds)))

    def result(self):
        return dict(start=self.start, end=self.end, stats=self.stats)


class StepTimer(L.Callback):
    def __init__(self):
        self.rec = Recorder()

    def on_train_batch_start(self, *args):
        self.rec.begin()

    def on_train_batch_end(self, *args):
        self.rec.finish()


_PATCHES = []  # (owner, attribute, original, timed wrapper) of our executor's functions, made once


def _instrument_executor(on: bool = True):
    """Time our executor's sends, receives and per-step log broadcast (wrapping, not editing), or with
    ``on=False`` put the originals back: the wrappers cost our executor cold Python that torch's does
    not pay (0-0.3% of a 1F1B step, side by side), so the throughput comparisons run without them."""
    if not _PATCHES:
        _make_patches()
    for owner, name, original, wrapper in _PATCHES:
        setattr(owner, name, wrapper if on else original)


def _patch(owner, name, wrap) -> None:
    original = getattr(owner, name)
    _PATCHES.append((owner, name, original, wrap(original)))


def _make_patches():
    from lightning_tp.pipeline.run import backward_step, executor, logs, transfers, user_step
    from lightning_tp.pipeline.transport import p2p

    def timing(fn, record):
        """fn, calling record(seconds, args) after each call."""
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                record(time.perf_counter() - t0, args)
        return wrapper

    def timed(fn, field):
        def record(dt, args):
            setattr(STATS, field, getattr(STATS, field) + dt)
        return timing(fn, record)

    def counting(send):
        """After each send, the bytes of sent tensors the Mailbox still keeps alive: gloo reports a send
        complete only once waited on, and the executor waits where a receive proves it landed (see
        pipeline/landed.py). Summed over the messages not yet released only (a few), not over every
        send of the step, which cost O(sends) per send (~3.6 ms a step at interleaved m=16)."""
        def wrapper(box, *args, **kwargs):
            out = send(box, *args, **kwargs)
            held = sum(t.numel() * t.element_size() for entries in box.by_tag.values() for _, t in entries
                       if t is not None)
            STATS.mailbox_peak = max(STATS.mailbox_peak, held)
            return out
        return wrapper

    _patch(p2p.Mailbox, "send", lambda f: timed(counting(f), "send"))
    _patch(p2p.Mailbox, "recv", lambda f: timed(f, "recv"))  # a channel's first message: its header's wait

    def arriving(fn):
        """A receive's wait, left by the executor to the stage's first block (an activation: inside an F,
        see StageRun.wait_for_activation) or made at once (a gradient): blocked time, not the action's own."""
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                STATS.recv += dt
                STATS.arrival_waits += dt
        return wrapper

    _patch(transfers, "_arrive", arriving)
    _patch(p2p.Mailbox, "wait", lambda f: timed(f, "wait"))
    _patch(executor.PipelineRunner, "train_step", lambda f: timed(f, "train_step"))
    _patch(logs.StageLogs, "publish", lambda f: timed(f, "publish"))
    from lightning_tp.pipeline.run import zb

    def action(fn, kind):
        def wrapper(*args, **kwargs):
            t0, waited = time.perf_counter(), STATS.arrival_waits
            try:
                return fn(*args, **kwargs)
            finally:  # less the receive's wait made inside it (see arriving)
                STATS.act[kind] += time.perf_counter() - t0 - (STATS.arrival_waits - waited)
                STATS.acts[kind] += 1
        return wrapper

    _patch(user_step.UserStep, "run", lambda f: action(f, "F"))  # training: one F each
    def backward(fn):  # "Bs": a split backward's input half (its W follows), "B": a whole backward
        timed = {kind: action(fn, kind) for kind in ("B", "Bs")}
        return lambda part, key, *args: timed["Bs" if key in part.plan.split else "B"](part, key, *args)

    _patch(backward_step.BackwardStep, "run", backward)
    _patch(zb.SplitBackward, "weight_grad", lambda f: action(f, "W"))


def parts(name: str) -> tuple:
    """(MegaStrategy schedule, split_backward) of a bench schedule name: "1f1b+split" runs
    split_backward=True, "1f1b+drain" split_backward="drain"."""
    base, _, flag = name.partition("+")
    return base, {"": False, "split": True, "drain": "drain"}[flag]


def run_ours(world, schedule, m, v, n_blocks, tf, tb, steps, timed=True):
    """Our executor inside a Lightning Trainer; ``timed``: with the executor's timing wrappers (the
    breakdown and Mailbox counts of bench/pipeline.py), else as shipped (its throughput)."""
    from lightning_tp import MegaStrategy

    _instrument_executor(timed)
    L.seed_everything(0, verbose=False)
    timer = StepTimer()
    trainer = L.Trainer(accelerator="cpu", devices=world,
                        strategy=MegaStrategy(pp=world, microbatches=m, schedule=parts(schedule)[0],
                                              split_backward=parts(schedule)[1], virtual_stages=v, timeout=120),
                        max_steps=steps, callbacks=[timer], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0, use_distributed_sampler=False)
    data = torch.utils.data.DataLoader(Batches(steps, m), batch_size=None)
    trainer.fit(SleepNet(n_blocks, tf, tb), data)
    return timer.rec.result()


def _torch_schedule(rank, world, schedule, m, v, n_blocks, tf, tb):
    """torch.distributed.pipelining stages of the same blocks, placed as ours (virtual stage
    k = chunk * p + rank): (schedule object, parameters, is first, is last)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

    torch.manual_seed(0)
    n_stages = world * v
    per_stage = n_blocks // n_stages
    stages, params = [], []
    for c in range(v):
        module = nn.Sequential(*(BLOCK(tf, tb) for _ in range(per_stage)))
        params += list(module.parameters())
        # shapes inferred at the first step (dynamic mode, a warm-up step here)
        stages.append(PipelineStage(module, c * world + rank, n_stages, torch.device("cpu")))
    if schedule == "1f1b":
        sched = Schedule1F1B(stages[0], m, loss_fn=F.mse_loss)
    elif schedule == "interleaved_1f1b":
        sched = ScheduleInterleaved1F1B(stages, m, loss_fn=F.mse_loss)
    else:
        raise ValueError(schedule)
    return sched, params, any(s.is_first for s in stages), any(s.is_last for s in stages)


def _torch_step(sched, first, last, x, y) -> list:
    losses = []
    sched.step(*((x,) if first else ()), **(dict(target=y, losses=losses) if last else {}))
    return losses


def run_torch(rank, world, schedule, m, v, n_blocks, tf, tb, steps):
    """torch.distributed.pipelining on the same blocks, in a plain training loop."""
    sched, params, first, last = _torch_schedule(rank, world, schedule, m, v, n_blocks, tf, tb)
    opt = torch.optim.SGD(params, lr=1e-3)
    data = Batches(1, m)
    rec = Recorder()
    dist.barrier()
    for _ in range(steps):
        rec.begin()
        x, y = data[0]
        _torch_step(sched, first, last, x, y)
        opt.step()
        opt.zero_grad()
        rec.finish()
    dist.barrier()
    return rec.result()


class TorchPipelined(L.LightningModule):
    """What a Lightning user writes to run torch.distributed.pipelining: the model rebuilt as the
    rank's stages, manual optimization, the loss logged where it exists (the last stage)."""

    def __init__(self, rank, world, schedule, m, v, n_blocks, tf, tb):
        super().__init__()
        self.automatic_optimization = False
        sched, params, self.first, self.last = _torch_schedule(rank, world, schedule, m, v, n_blocks, tf, tb)
        self.sched, self.stage_params = sched, nn.ParameterList(params)

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        losses = _torch_step(self.sched, self.first, self.last, *batch)
        opt.step()
        opt.zero_grad()
        if self.last:
            self.log("train_loss", torch.stack(losses).mean())

    def configure_optimizers(self):
        return torch.optim.SGD(self.stage_params.parameters(), lr=1e-3)


class _OwnRank(L.pytorch.strategies.SingleDeviceStrategy):
    """Each process trains its own stage on its CPU; the process group is the one already set up
    (torch's schedule talks over it), Lightning wraps and synchronises no gradients. It reports the
    process group's world size, so Lightning's loop does what it does in any multi-process run (a
    broadcast from rank 0 at every step, of whether it got SIGTERM), as it does around ours."""

    @property
    def is_global_zero(self) -> bool:
        return dist.get_rank() == 0

    @property
    def world_size(self) -> int:
        return dist.get_world_size()

    @world_size.setter
    def world_size(self, _) -> None:  # SingleDeviceStrategy sets 1
        pass


def run_torch_lightning(rank, world, schedule, m, v, n_blocks, tf, tb, steps):
    """torch.distributed.pipelining inside a Lightning Trainer (the same Trainer settings as ours)."""
    timer = StepTimer()
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=_OwnRank(torch.device("cpu")), max_steps=steps,
                        callbacks=[timer], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                        use_distributed_sampler=False)
    data = torch.utils.data.DataLoader(Batches(steps, m), batch_size=None)
    module = TorchPipelined(rank, world, schedule, m, v, n_blocks, tf, tb)
    dist.barrier()
    trainer.fit(module, data)
    dist.barrier()
    return timer.rec.result()


# ------------------------------------------------------------------------------ calibration


def calibrate(n_blocks_per_chunk, tf, tb, reps=12, warmup=3):
    """The model's own cost per action, with no executor around it: median seconds of one forward of
    ``n_blocks_per_chunk`` blocks (F), of its plain backward (B) and of the backward to the input
    only (Bi, zero-bubble's B; its W is then B - Bi). This is what any executor (ours or torch's)
    pays per action; the schedule's ideal built from it leaves out only what scheduling and
    communication cost. With fused blocks (BLOCK is FusedBlock) Bi and W time the split as our
    executor makes it, pipeline/run/zb.py's SplitBackward (input_grad, then weight_grad) on the
    blocks alone: whether W re-runs each fused node's backward or B already took the weights is
    the split's doing, not the schedule's, so it belongs to the model's cost."""
    fused = BLOCK is FusedBlock
    if fused:
        from lightning_tp.pipeline.run.zb import SplitBackward
    blocks = nn.Sequential(*(BLOCK(tf, tb) for _ in range(n_blocks_per_chunk)))
    params = list(blocks.parameters())
    x0 = torch.randn(ROWS, WIDTH)
    times = {"F": [], "B": [], "Bi": [], "W": []}
    for i in range(warmup + reps):
        for split in (False, True):
            x = x0.clone().requires_grad_()
            t0 = time.perf_counter()
            y = blocks(x)
            t1 = time.perf_counter()
            if split and fused:
                cut = SplitBackward(y, torch.ones_like(y), x, params)  # in B, as in the executor
                cut.input_grad()
                t2 = time.perf_counter()
                cut.weight_grad()
                t3 = time.perf_counter()
            elif split:
                torch.autograd.grad(y, x, torch.ones_like(y))
                t2 = time.perf_counter()
            else:
                y.backward(torch.ones_like(y))
                t2 = time.perf_counter()
            if i >= warmup:
                times["Bi" if split else "B"].append(t2 - t1)
                if not split:
                    times["F"].append(t1 - t0)
                elif fused:
                    times["W"].append(t3 - t2)
            for p in params:
                p.grad = None
    STATS.reset()
    out = {k: statistics.median(v) for k, v in times.items() if v}
    if not fused:
        out["W"] = out["B"] - out["Bi"]
    return out


# ------------------------------------------------------------------------------ probes


def probes(rank, world, reps=200):
    """Isolated costs: our Mailbox (header + payload) vs one plain isend/irecv, ping-pong between
    ranks 0 and 1; and the one float64 broadcast _publish sends each training step."""
    from lightning_tp.pipeline.transport.p2p import Mailbox

    out = {}
    t = torch.randn(ROWS, WIDTH)
    dist.barrier()
    for name in ("plain", "mailbox"):
        box = Mailbox()
        call = 0.0  # sender side: time inside the send call itself
        dist.barrier()
        t0 = time.perf_counter()
        if rank in (0, 1):
            peer = 1 - rank
            for i in range(reps):
                if (rank == 0) == (i % 2 == 0):
                    c0 = time.perf_counter()
                    if name == "plain":
                        work = dist.isend(t, peer, tag=10)
                        call += time.perf_counter() - c0
                        work.wait()
                    else:  # a fresh Mailbox: the first message of a step on a channel carries the header
                        box = Mailbox()
                        box.send(t, peer, 10, "probe")
                        call += time.perf_counter() - c0
                        box.wait()
                else:
                    if name == "plain":
                        r = torch.empty_like(t)
                        dist.irecv(r, peer, tag=10).wait()
                    else:
                        Mailbox().recv(peer, 10, torch.device("cpu"), "probe")
        out[f"{name}_one_way_ms"] = (time.perf_counter() - t0) / reps * 1e3
        out[f"{name}_send_call_ms"] = call / (reps // 2) * 1e3
        dist.barrier()
    buf = torch.zeros(64, dtype=torch.float64)  # what _publish broadcasts each training step
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(reps // 4):
        dist.broadcast(buf, src=world - 1)
    out["log_broadcast_ms"] = (time.perf_counter() - t0) / (reps // 4) * 1e3
    dist.barrier()
    return out


# ------------------------------------------------------------------------------ the launch


def _quiet() -> None:
    """Keep the bench's tables readable: each of the dozens of Trainers here would print Lightning's
    set-up lines (devices, tips, "fit stopped") on every rank. Set-up only, outside any timed step."""
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")


def worker(rank, world, plan, tf, tb, n_blocks, warmup, measured, blocks="split"):
    """plan: list of (impl, schedule, m, v), where a key may repeat (rounds, so that machine noise hits
    every run alike) and impl "probe" runs the overhead probes. Per key, the rounds are concatenated:
    start/end/stats per step and ``measured`` flags (warm-up steps of every round are False).
    ``blocks``: "split" (SleepBlock) or "fused" (FusedBlock), for every run of this process."""
    global BLOCK
    BLOCK = BLOCKS[blocks]
    _quiet()
    out = {}
    for impl, schedule, m, v in plan:
        if impl == "probe":
            out.setdefault("probes", []).append(probes(rank, world))
            continue
        if impl == "calibrate":  # per blocks-per-chunk count: this rank's model cost per action
            out.setdefault("calibration", []).append({k: calibrate(k, tf, tb) for k in schedule})
            continue
        if impl in ("ours", "ours_timed"):
            res = run_ours(world, schedule, m, v, n_blocks, tf, tb, warmup + measured, timed=impl == "ours_timed")
        else:
            if not dist.is_initialized():
                dist.init_process_group("gloo")
            run = run_torch if impl == "torch" else run_torch_lightning
            res = run(rank, world, schedule, m, v, n_blocks, tf, tb, warmup + measured)
        acc = out.setdefault((impl, schedule, m), dict(start=[], end=[], stats=[], measured=[]))
        for k in ("start", "end", "stats"):
            acc[k] += res[k]
        acc["measured"] += [i >= warmup for i in range(warmup + measured)]
    return out
