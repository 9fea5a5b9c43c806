"""``plan(model, gpus=..., ...)``: every layout MegaStrategy can run for the model on the cluster, estimated
and ranked by step time; those that do not fit listed apart with what overflows. See docs/planner.md."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from .cluster import Cluster
from .estimate import PRECISIONS, Candidate, estimate
from ..plans.lookup import blocks_path as planner_blocks
from .profile import profile
from .timing import time_blocks

RECOMPUTE = (False, "selective", True)
MICROBATCH_SIZES = (1, 2, 4, 8, 16, 32)


@dataclass
class Ranking:
    """Candidates that fit, fastest first, and those that do not (smallest memory first)."""

    fits: list
    overflows: list
    cluster: Cluster
    left_out: list = field(default_factory=list)  # the axes the strategy refuses for this model, and why

    def __getitem__(self, i):
        return self.fits[i]

    def __len__(self):
        return len(self.fits)

    def find(self, **layout) -> Candidate:
        """The candidate (fitting or not) with these fields, e.g. ``find(tp=2, pp=1, microbatch_size=4)``; the
        fields not given may take any value (the fastest such is returned)."""
        for c in self.fits + self.overflows:
            if all(getattr(c, k) == v for k, v in layout.items()):
                return c
        raise KeyError(f"no candidate with {layout} in this plan")

    def __str__(self):
        from .report import format_plan

        return format_plan(self)


def _divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(prof, cluster: Cluster, global_batch: int, zeros=(0, 1), recompute=RECOMPUTE,
               tp_most: int | None = None, cps=(1,)):
    """Every (tp, sp, cp, pp, dp, microbatch size, schedule, virtual stages, recompute, zero, ep) that divides the
    model (heads, layers, experts), the sequence (2 x cp chunks) and the batch, with tp groups in whole nodes."""
    most = min(cluster.gpus, tp_most or 2 * cluster.gpus_per_node)
    for t in prof.tps(most):
        if not (cluster.inside(t, 1) or t % cluster.gpus_per_node == 0):  # tp groups would straddle nodes
            continue
        for cp in cps:
            if cluster.gpus % (t * cp) or prof.seq % (2 * cp):
                continue
            for pp in _divisors(min(prof.layers, cluster.gpus // (t * cp))):
                if cluster.gpus % (t * cp * pp) or prof.layers % pp:
                    continue
                yield from _with_batch(prof, cluster, global_batch, zeros, recompute, t, cp, pp)


def _with_batch(prof, cluster, global_batch, zeros, recompute, t, cp, pp):
    dp = cluster.gpus // (t * cp * pp)
    if global_batch % dp:
        return
    eps = [e for e in _divisors(t * cp * dp) if prof.experts % e == 0] if prof.experts else [1]  # a stage's ranks
    for mbs in MICROBATCH_SIZES:
        if (global_batch // dp) % mbs:
            continue
        m = global_batch // dp // mbs
        if pp > 1 and m < pp:
            continue
        schedules = [("1f1b", 1)]
        if pp > 1:
            schedules += [("interleaved_1f1b", v) for v in (2, 4) if (prof.layers // pp) % v == 0 and m % pp == 0]
        for schedule, v in schedules:
            for sp in ((False, True) if t > 1 else (False,)):
                for ckpt, zero, ep in ((c, z, e) for c in recompute for z in zeros for e in eps):
                    if zero and dp * cp == 1 or (zero == 3 and (pp > 1 or ep > 1 or cp > 1)):  # zero=3: not under pp, ep, cp
                        continue
                    yield Candidate(tp=t, pp=pp, dp=dp, sp=sp, microbatch_size=mbs, microbatches=m,
                                    schedule=schedule, virtual_stages=v, activation_checkpointing=ckpt,
                                    zero=zero, ep=ep, cp=cp)


def plan(model, gpus: int, gpus_per_node: int = 8, gpu_memory_gib: float = 80.0, peak_tflops: float = 989.0,
         intra_node_gbps: float = 3600.0, inter_node_gbps: float = 400.0, global_batch: int = 512, seq_len: int = 2048,
         *, hbm_gbps: float = 26800.0, flash: bool = True, zeros=(0, 1), cluster: Cluster | None = None,
         model_plan="auto", precision: str = "bf16-mixed", recompute=RECOMPUTE, timed: bool = False,
         cps=None) -> Ranking:
    """The layouts for ``model`` (meta tensors are enough) on ``gpus`` GPUs, fastest first (``plan[0]``); options
    (``flash``, ``precision``, ``timed``, ``cps``: the context-parallel sizes to try): docs/planner.md. Raises
    when none fits, naming what overflows."""
    cluster = cluster or Cluster(gpus=gpus, gpus_per_node=gpus_per_node, gpu_memory_gib=gpu_memory_gib,
                                 peak_tflops=peak_tflops, intra_node_gbps=intra_node_gbps,
                                 inter_node_gbps=inter_node_gbps, hbm_gbps=hbm_gbps)
    if precision not in PRECISIONS:
        raise ValueError(f"plan(precision={precision!r}): choose one of {sorted(PRECISIONS)}.")
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise ValueError(f"plan(global_batch={global_batch!r}): a positive integer (sequences per step).")
    tps = [t for t in range(1, min(cluster.gpus, 2 * cluster.gpus_per_node) + 1) if cluster.gpus % t == 0]
    prof = profile(model, seq_len, tps, flash=flash, plan=model_plan, precision=precision)
    cps, left_out = _context_sizes(model, cluster.gpus, seq_len, cps)
    found = list(candidates(prof, cluster, global_batch, zeros, recompute, cps=cps))
    if timed:
        prof.timed = time_blocks(model, planner_blocks(model, model_plan), seq_len, prof.vocab, sorted({c.tp for c in found}),
                                 recompute, sorted({c.microbatch_size for c in found}),
                                 max(1, (os.cpu_count() or 1) // min(cluster.gpus, cluster.gpus_per_node)), model_plan,
                                 world=min(cluster.gpus, cluster.gpus_per_node))
    found = [estimate(c, prof, cluster, global_batch) for c in found]
    if not found:
        raise ValueError(f"plan(): no layout of {cluster.gpus} GPUs divides this model ({prof.layers} blocks, "
                         f"{prof.heads} heads) and global_batch={global_batch}.")
    fits = sorted((c for c in found if c.memory_gib <= cluster.gpu_memory_gib), key=lambda c: c.step_s)
    over = sorted((c for c in found if c.memory_gib > cluster.gpu_memory_gib), key=lambda c: c.memory_gib)
    for c in over:
        c.overflow = (f"{c.memory_gib:.1f} GiB > {cluster.gpu_memory_gib:g} GiB: " +
                      ", ".join(f"{k} {v:.1f}" for k, v in c.memory.items()))
    if not fits:
        raise ValueError(f"plan(): nothing fits in {cluster.gpu_memory_gib:g} GiB per GPU. The smallest layout, "
                         f"{_name(over[0])}, needs {over[0].overflow}. Add GPUs or memory, or shorten "
                         f"seq_len / the global batch.")
    return Ranking(fits, over, cluster, _left_out(prof.refused) + left_out)


def _context_sizes(model, gpus: int, seq_len: int, cps) -> tuple:
    """The cp sizes to try and, where the strategy refuses cp for this model, a line saying why."""
    if cps is None:
        cps = [c for c in (1, 2, 4, 8) if gpus % c == 0]
    if max(cps) == 1:
        return [1], []
    from ..context.model_checks import check_model

    try:
        check_model(model, max(cps))
    except ValueError as e:
        return [1], [f"cp={', '.join(str(c) for c in cps if c > 1)} left out (the strategy refuses it for this "
                     f"model): {e}"]
    return list(cps), []


def _left_out(refused: dict) -> list:
    """One line per reason: the tp sizes the strategy refuses for the model, and its words."""
    by_reason = {}
    for t, why in sorted(refused.items()):
        by_reason.setdefault(why, []).append(t)
    return [f"tp={', '.join(map(str, ts))} left out (the strategy refuses it for this model): {why}"
            for why, ts in by_reason.items()]


def _name(c: Candidate) -> str:
    return (f"tp={c.tp}{' sp' if c.sp else ''}{f' cp={c.cp}' if c.cp > 1 else ''} pp={c.pp} dp={c.dp} "
            f"microbatch {c.microbatch_size}"
            f" x {c.microbatches}"
            f"{f' {c.schedule} v={c.virtual_stages}' if c.pp > 1 else ''} recompute={c.activation_checkpointing} "
            f"zero={c.zero}{f' ep={c.ep}' if c.ep > 1 else ''}")
