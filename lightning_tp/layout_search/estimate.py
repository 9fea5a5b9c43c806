"""One layout's memory and step time on a cluster: compute at the GEMM sizes per rank, elementwise traffic,
tp/pp/dp communication, the schedule's bubble and recomputation. See docs/planner.md."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from ..dp.grads import BUCKET_BYTES
from ..pipeline.schedule.schedules import build_schedule
from ..pipeline.schedule.simulate import simulate

GIB = 2 ** 30
# per precision: (activation bytes, per-parameter weight, gradient and Adam-state bytes)
PRECISIONS = {"bf16-mixed": (2, dict(weight=4, grad=4, optim=8)),  # fp32 parameters under autocast
              "megatron": (2, dict(weight=2, grad=4, optim=12)),  # bf16 weights, fp32 gradients and main copy
              "bf16-true": (2, dict(weight=2, grad=2, optim=4)),
              "32-true": (4, dict(weight=4, grad=4, optim=8))}


@dataclass
class Candidate:
    """A layout (what MegaStrategy takes, and the microbatch size) with its estimates; ``why``: the step's
    parts (seconds), ``overflow``: what does not fit (empty when it does)."""

    tp: int
    pp: int
    dp: int
    sp: bool
    microbatch_size: int
    microbatches: int
    schedule: str
    virtual_stages: int
    activation_checkpointing: object
    zero: int
    ep: int = 1  # experts split over ep of a stage's tp x cp x dp ranks
    cp: int = 1  # each sequence split over cp ranks (context parallelism)
    memory_gib: float = 0.0
    memory: dict = field(default_factory=dict)
    step_s: float = 0.0
    tokens_per_s: float = 0.0
    mfu: float = 0.0
    hardware_tflops: float = 0.0
    why: dict = field(default_factory=dict)
    overflow: str = ""
    stage_seconds: tuple = (0.0, 0.0)  # one stage's forward and backward of one microbatch

    def strategy_kwargs(self) -> dict:
        """The MegaStrategy options of this layout (without a pipeline the microbatches are Lightning's
        accumulate_grad_batches, see :meth:`trainer_kwargs`)."""
        out = dict(tp=self.tp, pp=self.pp, sp=self.sp, zero=self.zero,
                   activation_checkpointing=self.activation_checkpointing)
        if self.ep > 1:
            out["ep"] = self.ep
        if self.cp > 1:
            out["cp"] = self.cp
        if self.pp > 1:
            out.update(microbatches=self.microbatches, schedule=self.schedule, virtual_stages=self.virtual_stages)
        return out

    def timeline_png(self, path):
        """Draw this layout's step, as estimated, to ``path`` (a PNG, a row per pp rank); returns the replay."""
        from .picture import draw, schedule_rows

        f, b = self.stage_seconds
        v = self.virtual_stages
        result = simulate(build_schedule(self.schedule, self.pp, self.microbatches, v), self.pp, v,
                          {"F": f / v, "B": b / v})
        draw(schedule_rows(result), path)
        return result

    def trainer_kwargs(self) -> dict:
        """The Trainer options: GPUs, and accumulation where there is no pipeline to take the microbatches."""
        out = dict(devices=self.tp * self.cp * self.pp * self.dp)
        if self.pp == 1 and self.microbatches > 1:
            out["accumulate_grad_batches"] = self.microbatches
        return out


@functools.lru_cache(maxsize=None)
def peak_inflight(schedule: str, pp: int, v: int, m: int) -> int:
    """Microbatch-chunks the first stage holds at once (it holds the most), from a replay of the schedule."""
    if pp == 1:
        return 1
    m = min(m, 2 * pp * v)  # the peak no longer grows past a few rounds
    m -= m % pp if schedule == "interleaved_1f1b" and m > pp else 0
    return max(simulate(build_schedule(schedule, pp, m, v), pp, v).peak_inflight)


def pipeline_seconds(pp: int, v: int, m: int, f: float, b: float) -> float:
    """1F1B (and interleaved) makespan with per-stage forward ``f`` and backward ``b`` per microbatch."""
    return m * (f + b) + (pp - 1) * (f + b) / v


def estimate(c: Candidate, prof, cluster, global_batch: int) -> Candidate:
    """Fill ``c``'s memory, step time and rates (see docs/planner.md for each term)."""
    s, h, t, L = prof.seq, prof.hidden, c.tp, prof.layers
    act_bytes, BYTES = PRECISIONS[prof.precision]
    tokens = c.microbatch_size * s // c.cp  # per microbatch, on this rank (cp: its share of each sequence)
    replicas = c.dp * c.cp  # the ranks averaging the same gradients
    per_block_act, outer_act, transient = prof.act[(t, c.sp, c.activation_checkpointing)]
    block_p, outer_p = prof.params_at[t]
    layers_here = L // c.pp
    block_experts = prof.expert_params_at.get(t, 0)  # ep: a rank keeps 1/ep of each layer's experts
    params_here = layers_here * (block_p - block_experts * (1 - 1 / c.ep)) + outer_p  # the first (or last) stage
    experts_here, edp = layers_here * block_experts / c.ep, t * c.cp * c.dp // c.ep  # edp: holding the same experts
    # the optimizer steps (zero: its slices; dp's of the rest, the expert-dp group's of the experts)
    stepped = (params_here - experts_here) / replicas + experts_here / edp if c.zero else params_here
    # memory: weights, gradients, optimizer state (zero=1: state / dp; zero=3: all three / dp), activations
    shard = c.dp if c.zero == 3 else 1
    memory = dict(weights=params_here * BYTES["weight"] / shard, grads=params_here * BYTES["grad"] / shard,
                  optimizer=stepped * BYTES["optim"])
    inflight = peak_inflight(c.schedule, c.pp, c.virtual_stages, c.microbatches)
    chunk = layers_here // c.virtual_stages
    # under a pipeline the gradients stay while the stage holds its peak microbatches, and a block's backward
    # makes its input's gradients next to them: one block's activations (recomputed ones count it already)
    working = per_block_act if c.pp > 1 and not transient else 0
    memory["activations"] = c.microbatch_size * (inflight * chunk * per_block_act + outer_act + transient + working) / c.cp
    if c.zero == 1 and c.pp == 1:  # the forward holds last step's slices of the gradients; the backward's end
        # every gradient twice (copied into its bucket's buffer): the parts alive at the larger of the two
        whole, memory["grads"] = memory["grads"], memory["grads"] / replicas
        if 2 * whole > memory["grads"] + memory["activations"]:
            memory.update(grads=2 * whole, activations=0.0)
    c.memory = {k: v / GIB for k, v in memory.items()}
    c.memory_gib = sum(c.memory.values())
    # compute per microbatch on one stage: GEMMs at this rank's size, elementwise traffic, tp collectives
    gemm = tokens * h * (h / t) * 2 / 1e9  # one h x h/t product, GFLOP
    fwd_flops = tokens * (prof.block_flops / t) * layers_here
    core = tokens * (prof.core_flops / t) * layers_here
    recompute = {False: 0.0, "selective": core, True: fwd_flops}[c.activation_checkpointing]
    head = tokens * prof.outer_flops / t
    f_gemm = cluster.gemm_seconds(fwd_flops + head, gemm)
    # elementwise kernels stream each activation a forward makes about three times (written, read by the
    # next op, read back in the backward): what the block saves without recomputation
    made = prof.act[(t, c.sp, False)][0]
    traffic = cluster.memory_seconds(3 * c.microbatch_size * made * layers_here)
    hidden_bytes = tokens * h * act_bytes
    tp_one = (cluster.collective_seconds("sp_reduce_scatter", hidden_bytes, t) +
              cluster.collective_seconds("sp_all_gather", hidden_bytes, t)) if c.sp else \
        cluster.collective_seconds("tp_all_reduce", hidden_bytes, t)
    tp_fwd = 2 * (layers_here + prof.tp_outer.get((t, c.sp), 0.0)) * tp_one  # (the outer ones: half in each pass)
    f = f_gemm + traffic + tp_fwd
    again = {False: 0.0, "selective": 0.0, True: 1.0}[c.activation_checkpointing]  # a whole forward again
    re_gemm = cluster.gemm_seconds(recompute, gemm)
    b = 2 * f_gemm + (2 + again) * traffic + (1 + again) * tp_fwd + re_gemm
    timed = prof.timed.get((t, c.activation_checkpointing, c.microbatch_size))
    if timed:  # the model's own blocks timed at this rank's shapes (see .timing): compute as measured, with
        *seconds, together = timed  # every process at work (else the slowdown measured for that applied)
        block_f, block_b, outer_f, outer_b = (x * (1.0 if together else cluster.compute_slowdown) for x in seconds)
        f_gemm, traffic, re_gemm = layers_here * block_f + outer_f, 0.0, 0.0
        f = f_gemm + tp_fwd
        b = layers_here * block_b + outer_b + (1 + again) * tp_fwd
    p2p = cluster.collective_seconds("p2p", hidden_bytes / (t if c.sp else 1), 2, t * c.dp) if c.pp > 1 else 0.0
    calls, width = prof.a2a  # ep: each MoE layer's dispatch and combine, forward and backward
    a2a = layers_here * calls * cluster.collective_seconds(  # ep groups: consecutive ranks; each tp rank sends
        "all_to_all", tokens / t * width * act_bytes, c.ep, 1) if c.ep > 1 else 0.0  # 1/tp (sp shard or share)
    # cp's ring: per layer K/V passed on cp - 1 times forward and again backward, dK/dV (fp32) cp times back,
    # each transfer hidden behind one block of the attention core (the core's FLOPs over cp steps)
    ring_f = ring_b = 0.0
    if c.cp > 1:
        kv = tokens * 2 * h / t * act_bytes
        one = cluster.collective_seconds("p2p", kv, 2, t)
        core_step = cluster.gemm_seconds(tokens * prof.core_flops / t, gemm) / c.cp
        ring_f = layers_here * (c.cp - 1) * max(0.0, one - core_step)
        ring_b = layers_here * ((c.cp - 1) * max(0.0, one - 2 * core_step) +
                                c.cp * cluster.collective_seconds("p2p", kv * 4 / act_bytes, 2, t))
    f, b = f + p2p + a2a / 2 + ring_f, b + p2p + a2a / 2 + ring_b
    pipe = pipeline_seconds(c.pp, c.virtual_stages, c.microbatches, f, b)
    c.stage_seconds = (f, b)
    # data parallel: the gradient all-reduce (zero=1: reduce-scatter + all-gather, zero=3: also the weights'
    # gathers), overlapped with the last microbatch's backward; the optimizer streams its state once
    grads = params_here * BYTES["grad"]

    def over_dp(op, per_param):  # the experts' over the ranks holding the same ones (ep > 1), the rest over dp
        return cluster.collective_seconds(op, (params_here - experts_here) * per_param, replicas, t) + \
            cluster.collective_seconds(op, experts_here * per_param, edp, c.ep)
    if c.zero:  # the reduce-scatter overlapped; the stepped slices' all-gather after the step (zero=3: the
        # weights' gathers, twice a block, inside the forward and backward)
        dp_time = over_dp("dp_reduce_scatter", BYTES["grad"])
        gather = over_dp("dp_all_gather", BYTES["weight"]) * (2 * c.microbatches if c.zero == 3 else 1)
    else:
        dp_time, gather = over_dp("dp_all_reduce", BYTES["grad"]), 0.0
    # the last bucket starts when the backward ends: its collective is never hidden; the others, the share the
    # backward hides (on CPU less than all: they share the cores)
    last = (grads % BUCKET_BYTES or min(grads, BUCKET_BYTES)) / grads if grads else 0.0
    exposed = max(dp_time - b, dp_time * (last + (1 - last) * (1 - cluster.comm_overlap))) + gather
    per_param = prof.timed.get(("optimizer", t)) or cluster.optimizer_s_per_param  # timed on the model's weights
    optimizer = stepped * per_param if per_param else \
        cluster.memory_seconds(stepped * (BYTES["optim"] + 2 * BYTES["grad"]) * 2)
    if c.pp > 1:  # one training step, each microbatch a forward and a backward per chunk
        overhead = cluster.step_overhead_s + 2 * c.microbatches * c.virtual_stages * cluster.action_overhead_s
    else:  # Lightning's accumulation: a training step per microbatch
        overhead = c.microbatches * cluster.step_overhead_s
    c.step_s = pipe + exposed + optimizer + overhead
    c.why = dict(compute=c.microbatches * (f + b - (2 + again) * tp_fwd - 2 * p2p - a2a - ring_f - ring_b if timed
                                           else f_gemm * 3 + re_gemm),
                 elementwise=c.microbatches * traffic * 3, tp=c.microbatches * (2 * tp_fwd), pp_p2p=c.microbatches * 2 * p2p,
                 ep_all_to_all=c.microbatches * a2a, cp_ring=c.microbatches * (ring_f + ring_b),
                 bubble=(c.pp - 1) * (f + b) / c.virtual_stages, dp_exposed=exposed, optimizer=optimizer,
                 overhead=overhead)
    c.tokens_per_s = global_batch * s / c.step_s
    model_flops = 3 * (L * prof.block_flops + prof.outer_flops) * global_batch * s  # forward + backward
    hardware = model_flops + (L * (prof.core_flops if c.activation_checkpointing == "selective" else prof.block_flops)
                              * global_batch * s if c.activation_checkpointing else 0.0)
    gpus = c.tp * c.cp * c.pp * c.dp
    c.mfu = model_flops / (c.step_s * gpus * cluster.peak_tflops * 1e12)
    c.hardware_tflops = hardware / (c.step_s * gpus) / 1e12
    return c
