"""Pipeline executor benchmark: measured step time vs the schedule's ideal, ours vs
torch.distributed.pipelining, and peak live activations per stage, all measured in one run.

The model is a list of blocks whose cost is fixed by sleeping (forward ``tf``, backward ``tb``), so
the ideal step time of every schedule is known exactly from ``simulate()`` and the two CPU cores do
not matter (sleeping processes do not compete). Each block also multiplies a 64x256 fp32 activation
by a learnable vector, so gradients flow and every saved activation has a known size (64 KiB).

One launch of 4 local processes (lightning_tp.testing.run_local) runs, for m in (8, 16): our MegaStrategy(pp=4)
inside a real Lightning Trainer for each schedule (a plain name: split_backward=False, the textbook
schedule; "+drain": what the default picks, see SCHEDULES), torch's Schedule1F1B and ScheduleInterleaved1F1B
on the same blocks in a plain loop and inside the same Trainer, a calibration of the model's own
per-action cost (no executor) and isolated overhead probes. All of it ROUNDS times, interleaved,
so that load from other processes on the box hits every run alike.

``--blocks fused`` swaps each block for one whose backward is ONE custom autograd.Function returning
the input's and the weight's gradients together (tb for both), as flash attention, fused MLP/norm
kernels, Triton ops and QAT layers do: there is no weight branch a split backward can defer for free.
It runs 1F1B and interleaved 1F1B, each as the default and textbook schedules, next to torch's, and
5) lists default, textbook and torch side by side. Its nominal ideal is the schedule with no work done
twice (a split B runs the whole fused backward, its W nothing), i.e. the textbook schedule's; its
model ideal times the split as our executor makes it (pipeline/run/zb.py's SplitBackward on the
model, no executor around it), so a W that re-runs the fused backward shows in measured/nominal.

Ideal times come from simulate() (and, for ZB-H1 under our executor, a replay with the same event
rules and a per-rank cost); the executor's sends, receives and log broadcast are timed by wrapping
them in the worker processes, nothing in lightning_tp is changed. Those wrappers cost our executor
cold Python that torch's does not pay, so they are on in one extra run per schedule and m (the
breakdown and the Mailbox counts) and off in the runs whose throughput and spans are compared.

    .venv/bin/python bench/pipeline.py [--block-ms 10] [--microbatches 8,16] [--also 1f1b+split]
        [--blocks split|fused] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from lightning_tp.testing import run_local  # noqa: E402
from _pipeline_model import ROWS, WIDTH, parts, worker  # noqa: E402

from lightning_tp.pipeline.schedule.landed import landed_after  # noqa: E402
from lightning_tp.pipeline.schedule.schedules import build_schedule, message, split_keys  # noqa: E402
from lightning_tp.pipeline.schedule.simulate import simulate  # noqa: E402

P = 4  # pipeline stages = world size
MS = (8, 16)  # microbatches (--microbatches)
TF, TB = 0.010, 0.020  # seconds per block: forward sleep, backward sleep (tb = 2 tf)
N_BLOCKS = 8  # 2 blocks per stage; interleaved v=2: 1 block per virtual stage
WARMUP, MEASURED, ROUNDS = 2, 6, 3  # per run: steps skipped, steps timed; every run is repeated ROUNDS times
# a plain name runs MegaStrategy(split_backward=False), the textbook schedule; "+drain" runs
# split_backward="drain", what the default ("auto") picks here: the backwards after each rank's last
# forward split as ZB-H1's, each W at once; "+split" (--schedules) split_backward=True, every backward
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("1f1b+drain", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b+drain", 2),
             ("zb_h1", 1)]
DEFAULT = {"1f1b+drain", "interleaved_1f1b+drain"}  # MegaStrategy's default (split_backward="auto") at pp=4
TORCH = {"1f1b": "Schedule1F1B", "interleaved_1f1b": "ScheduleInterleaved1F1B"}
# --blocks: "split" (SleepBlock: half the backward on the weight's own branch) or "fused" (FusedBlock:
# one autograd.Function computing both gradients); fused runs only the schedules torch has
BLOCKS = "split"
FUSED_SCHEDULES = [("1f1b", 1), ("1f1b+drain", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b+drain", 2)]
ACT_BYTES = ROWS * WIDTH * 4  # saved activation of one block for one microbatch


def splits(name: str) -> bool:
    """Whether the schedule splits backwards into B (input half) and W (weight half)."""
    return name == "zb_h1" or bool(parts(name)[1])


def label(name: str) -> str:
    return name + " (default)" if name in DEFAULT else name


def build(name: str, m: int, v: int):
    base, split = parts(name)
    return build_schedule(base, P, m, v, split_backward=split)


def torch_runs(name: str, m: int) -> bool:
    """Whether torch has the schedule for m: its interleaved 1F1B needs m divisible by max(1, m // p)."""
    return name in TORCH and (name != "interleaved_1f1b" or m % max(1, m // P) == 0)


# ------------------------------------------------------------------------------ ideal times


def replay(schedule, p, v, duration, latency: float = 0.0, rendezvous: bool = False) -> float:
    """Makespan with a per-rank cost, ``duration(rank, action)``; same event rules as simulate()
    (sends never block, a RECV waits for its SEND). Needed for ZB-H1 under our executor, where
    rank 0's B is free (no input gradient to compute) but every other rank's B is a full backward.
    ``latency``: seconds a message takes; with ``rendezvous`` it is paid after both sides are ready
    (gloo moves the data only once the receive is posted), else from the send."""
    clock, pc, sent = [0.0] * p, [0] * p, {}
    progressed = True
    while progressed:
        progressed = False
        for r in range(p):
            ops = schedule[r]
            while pc[r] < len(ops):
                a = ops[pc[r]]
                if a.kind in ("SEND_F", "SEND_B"):
                    sent[message(a, r, p)] = clock[r]
                elif a.kind in ("RECV_F", "RECV_B"):
                    key = message(a, r, p)
                    if key not in sent:
                        break
                    clock[r] = max(clock[r], sent[key]) + latency if rendezvous else \
                        max(clock[r], sent[key] + latency)
                else:
                    clock[r] += duration(r, a)
                pc[r] += 1
                progressed = True
    assert all(pc[r] == len(schedule[r]) for r in range(p)), "replay deadlocked"
    return max(clock)


def split_cost(sched, cost):
    """Per-action duration, ``dur(rank, action)``, of a schedule whose backwards may be split (see
    with_split_backward), from ``cost(rank, kind)`` for F, B (a whole backward), Bi (its input half)
    and W: a split B is the input half, free on the first virtual stage (no input gradient), whose
    W is then the whole backward; any other B is whole."""
    keys = [split_keys(ops) for ops in sched]

    def dur(r, a):
        first = r == 0 and a.chunk == 0
        if a.kind == "W":
            return cost(r, "B" if first else "W")
        if a.kind == "B" and (a.microbatch, a.chunk) in keys[r]:
            return 0.0 if first else cost(r, "Bi")
        return cost(r, a.kind)
    return dur


def calibrated_ideal(name, sched, v, cal) -> tuple:
    """(ideal step time, per-action cost) of a schedule with each rank's per-action cost as measured by
    calibrate() (the model alone, no executor); a split backward as our executor splits it (the first
    virtual stage: B free, W the whole backward)."""
    per = N_BLOCKS // (P * v)
    dur = split_cost(sched, lambda r, kind: cal[r][per][kind])
    return replay(sched, P, v, dur), dur


def ideals(m: int) -> dict:
    """Per schedule: the schedule, its per-action cost (s) with F = tf and B = tb per block per chunk,
    and its ideal step time (no communication cost)."""
    out = {}
    for name, v in SCHEDULES:
        sched = build(name, m, v)
        per = N_BLOCKS // (P * v)  # blocks per virtual stage
        if not splits(name):
            cost = {"F": per * TF, "B": per * TB}
            res = simulate(sched, P, v, cost)
            dur = lambda r, a, cost=cost: cost[a.kind]  # noqa: E731
            # the replay follows simulate's rules: check it agrees before trusting it for ZB below
            assert abs(replay(sched, P, v, dur) - res.makespan) < 1e-9
            out[name] = dict(sched=sched, v=v, dur=dur, ideal=res.makespan, peak=res.peak_inflight, busy=res.busy,
                             model=f"simulate F={per * TF * 1e3:.0f} B={per * TB * 1e3:.0f}")
            continue
        # fused blocks: nothing of a backward can be deferred; the nominal split does no work twice
        # (B the whole backward, W nothing): the textbook schedule's cost
        bi, w = (per * TB, 0.0) if BLOCKS == "fused" else (per * TB / 2, per * TB / 2)
        # (a) the paper's split, simulate()'s convention: B (input grad) + W (weight grad) = one backward
        split = simulate(sched, P, v, {"F": per * TF, "B": per * TB, "W": w})
        # (b) what our executor does (pipeline/zb.py): B = the input-gradient half of the stage's
        # backward, W = the weight half; the first virtual stage has no input gradient, so its B is free
        # and its W the whole backward. simulate() takes one cost per kind for all ranks, hence the replay.
        nominal = {"F": per * TF, "B": per * TB, "Bi": bi, "W": w}
        dur = split_cost(sched, lambda r, kind, c=nominal: c[kind])
        busy = [sum(dur(r, a) for a in sched[r] if a.kind in ("F", "B", "W")) for r in range(P)]
        out[name] = dict(sched=sched, v=v, dur=dur, ideal=replay(sched, P, v, dur), peak=split.peak_inflight,
                         busy=busy, split=split.makespan,
                         model=f"replay F={per * TF * 1e3:.0f} B={per * TB * 1e3:.0f}, "
                               f"split: B={bi * 1e3:.0f} "
                               f"W={w * 1e3:.0f}, rank 0 chunk 0 B=0 W={per * TB * 1e3:.0f}")
    return out


def held_by_rule(sched) -> list:
    """Per rank: peak sent messages alive when each is dropped at the receive that proves it landed."""
    points, out = landed_after(sched, P), []
    for r, ops in enumerate(sched):
        held = peak = 0
        for i, a in enumerate(ops):
            held += a.kind.startswith("SEND")
            peak = max(peak, held)
            held -= len(points[r].get(i, []))
        out.append(peak)
    return out


# ------------------------------------------------------------------------------ reducing measurements


def _measured(per_rank):
    return [i for i, flag in enumerate(per_rank[0]["measured"]) if flag]


def steps_of(per_rank):
    """Medians over measured steps of the span over ranks (last end - first start) and of the period
    (time from the previous step's end to this one's, slowest rank). Medians: load from other processes
    on the box shows up as occasional slow steps."""
    idx = _measured(per_rank)  # warm-up >= 1, so step i - 1 belongs to the same run
    spans = [max(r["end"][i] for r in per_rank) - min(r["start"][i] for r in per_rank) for i in idx]
    periods = [max(r["end"][i] - r["end"][i - 1] for r in per_rank) for i in idx]
    return statistics.median(spans), statistics.median(periods)


def rounds_of(per_rank) -> list:
    """The runs of one key, one per round (measure() concatenates them), each shaped like ``per_rank``."""
    n = WARMUP + MEASURED
    count = len(per_rank[0]["measured"]) // n
    return [[{k: r[k][i * n:(i + 1) * n] for k in ("start", "end", "stats", "measured")} for r in per_rank]
            for i in range(count)]


def round_ratios(ours, theirs) -> list:
    """Throughput ours/theirs within each round (the two ran minutes apart at most): how far the ratio
    moves with the box's load, against which a median ratio of 0.99 or 1.01 is to be read."""
    return [steps_of(t)[1] / steps_of(o)[1] for o, t in zip(rounds_of(ours), rounds_of(theirs))]


def work_spans(per_rank):
    """Median over measured steps of the span from the first block's work on any rank to the last
    block's on any rank: the pipeline itself, without what happens between steps."""
    idx = _measured(per_rank)
    return statistics.median(max(r["stats"][i]["last_work"] for r in per_rank)
                             - min(r["stats"][i]["first_work"] for r in per_rank) for i in idx)


def exposures(per_rank, name: str, m: int):
    """Per transfer on a v=1 schedule, where the receiver waits for it (its previous action ended 0.5 ms
    or more before the message's block did): from the sender's last block's end to the receiver's
    first block's start, median over measured steps (forward, backward) in seconds. What a transfer
    costs on the critical path: the executor's code on both sides plus the link."""
    sched, per = build_schedule(name, P, m, 1), N_BLOCKS // P
    halves = 1 if BLOCKS == "fused" else 2  # timed holds per block backward: one fused node, or two halves
    fwd, bwd = [], []
    for i in _measured(per_rank):
        acts = []  # per rank: {(kind, microbatch): (start, end)} and the end of the action before each
        for rank, r in enumerate(per_rank):
            holds = r["stats"][i]["holds"]
            f = [h for h in holds if h[2] == "F"]
            b = [h for h in holds if h[2] == "B"]
            k = halves * per  # holds per stage backward
            if len(f) != per * m or len(b) != k * m:  # not this step's blocks alone: skip it
                break
            fs = iter((f[j][0], f[j + per - 1][1]) for j in range(0, len(f), per))
            bs = iter((b[j][0], b[j + k - 1][1]) for j in range(0, len(b), k))
            spans, before, last = {}, {}, None
            for a in sched[rank]:
                if a.kind in ("F", "B"):
                    spans[(a.kind, a.microbatch)] = span = next(fs if a.kind == "F" else bs)
                    before[(a.kind, a.microbatch)], last = last, span[1]
            acts.append((spans, before))
        else:
            for mb in range(m):
                for s in range(P - 1):
                    for kind, src, dst, out in (("F", s, s + 1, fwd), ("B", s + 1, s, bwd)):
                        sent = acts[src][0][(kind, mb)][1]
                        ready = acts[dst][1][(kind, mb)]
                        if ready is not None and ready < sent - 0.5e-3:
                            out.append(acts[dst][0][(kind, mb)][0] - sent)
    return (statistics.median(fwd) if fwd else float("nan")), (statistics.median(bwd) if bwd else float("nan"))


def action_costs(per_rank) -> list:
    """Per rank: the median over measured steps of each action kind's mean duration (s), as timed
    inside our executor (the block's sleeps plus its real compute and the executor's own code)."""
    idx = _measured(per_rank)
    return [{k: statistics.median(r["stats"][i]["act"][k] / max(r["stats"][i]["acts"][k], 1) for i in idx)
             for k in ("F", "B", "Bs", "W")} for r in per_rank]


def stat(per_rank, field, reduce=statistics.median):
    """Per rank: the field reduced over measured steps."""
    return [reduce(r["stats"][i][field] for i in _measured(per_rank)) for r in per_rank]


def header():
    print("=" * 108)
    print("Pipeline benchmark: MegaStrategy executor (inside a Lightning Trainer) on a sleep-cost block model")
    print(f"  p={P} stages (world 4, gloo, CPU), {N_BLOCKS} blocks (2 per stage; interleaved v=2: 1 per virtual "
          f"stage), m in {MS}")
    print(f"  block cost: forward sleep tf={TF * 1e3:.0f} ms, backward sleep tb={TB * 1e3:.0f} ms; activation "
          f"{ROWS}x{WIDTH} fp32 = {ACT_BYTES // 1024} KiB per block per microbatch")
    if BLOCKS == "fused":
        print("  blocks: FUSED (--blocks fused): each block's backward is one custom autograd.Function returning the "
              "input's\n  and the weight's gradients together (tb for both; no weight branch a split could defer)")
    else:
        print("  blocks: split (default): half of each block's backward on the input's path, half on the weight's "
              "own branch")
    print(f"  every run done {ROUNDS} times, interleaved (other processes may load this 2-core box); per run "
          f"{WARMUP} warm-up steps skipped,\n  {MEASURED} measured; step time = median over measured steps of "
          f"(last rank's on_train_batch_end - first rank's on_train_batch_start)")
    print("  targets: measured/ideal <= 1.05;  throughput ours/torch >= 1.0;  peak live activations "
          "GPipe ~ m, 1F1B ~ p - s")
    print(f"  schedules: {', '.join(n for n, _ in SCHEDULES)}")
    print("=" * 108, flush=True)


def measure():
    plan = []
    for i in range(ROUNDS):  # rounds, so that load from other processes on this box hits every run alike
        for m in MS:
            for name, v in SCHEDULES:  # ours next to torch's on the schedules both have
                if i == 0:  # once, with the executor's timing wrappers: the breakdown and Mailbox counts
                    plan.append(("ours_timed", name, m, v))
                plan.append(("ours", name, m, v))  # as shipped: every throughput and span
                if torch_runs(name, m):
                    plan.append(("torch", name, m, v))
                    plan.append(("torch_lightning", name, m, v))
            plan.append(("probe", None, m, None))
        plan.append(("calibrate", (N_BLOCKS // P, N_BLOCKS // (2 * P)), None, None))
    # generous: 6 schedules x 3 rounds at 20 ms blocks take ~20 min; a stuck rank fails sooner (timeout=120)
    return run_local(P, worker, plan, TF, TB, N_BLOCKS, WARMUP, MEASURED, BLOCKS, timeout=3600)


def report(results):
    get = lambda key: [r[key] for r in results]  # noqa: E731
    ms = lambda x: f"{x * 1e3:.1f}"  # noqa: E731
    # probes: median over the rounds of the slowest rank
    probe = {k: statistics.median(max(r["probes"][i][k] for r in results) for i in range(len(results[0]["probes"])))
             for k in results[0]["probes"][0]}
    link = probe["plain_one_way_ms"] / 1e3  # one transfer whose receive is posted (ours are, from step 2 on)
    # per rank, per blocks-per-chunk: the model's own cost per action, median over the rounds
    cals = [r["calibration"] for r in results]
    cal = [{k: {a: statistics.median(c[k][a] for c in per_rank) for a in per_rank[0][k]} for k in per_rank[0]}
           for per_rank in cals]

    # ---- 1. measured vs ideal
    print("\n1) Our executor: measured step time vs the schedule's ideal (free communication, no executor cost)")
    print("   'nominal': blocks cost exactly tf / tb.  'model': each rank's per-action cost of the model itself,\n"
          "   timed in the same processes with no executor around it (calibrate(): the blocks' own work and\n"
          "   autograd's per-node cost, which any executor pays, ours and torch's alike; below, per rank);\n"
          "   its ratio is what scheduling and communication cost on top of the work.")
    print(f"   'model+link': that replay where each P2P transfer costs the one-way latency measured in 4) "
          f"({link * 1e3:.2f} ms,\n   plain isend/irecv; paid once sender and receiver are both there, as gloo "
          f"does).\n"
          "   'as timed': the replay with each rank's F/B/W as timed inside our executor (model + our per-action code)")
    hdr = (f"{'schedule':<34}{'m':>3}  {'measured ms':>11}  {'nominal':>8}  {'ratio':>6}  {'model':>7}  {'ratio':>6}  "
           f"{'target':>6}  {'model+link':>10}  {'ratio':>6}  {'as timed':>8}  {'ratio':>6}")
    print(hdr)
    print("-" * len(hdr))
    ideal_by_m, measured, models = {m: ideals(m) for m in MS}, {}, {}
    for m in MS:
        for name, v in SCHEDULES:
            span, period = steps_of(get(("ours", name, m)))
            measured[(name, m)] = (span, period)
            idl = ideal_by_m[m][name]
            model, model_dur = calibrated_ideal(name, idl["sched"], v, cal)
            with_link = replay(idl["sched"], P, v, model_dur, link, rendezvous=True)
            costs = action_costs(get(("ours_timed", name, m)))
            keys = [split_keys(ops) for ops in idl["sched"]]
            timed = replay(idl["sched"], P, v, lambda r, a, c=costs, keys=keys:
                           c[r]["Bs" if a.kind == "B" and (a.microbatch, a.chunk) in keys[r] else a.kind])
            ratio = span / model
            models[(name, m)] = model
            print(f"{label(name):<34}{m:>3}  {ms(span):>11}  {ms(idl['ideal']):>8}  {span / idl['ideal']:>6.3f}  "
                  f"{ms(model):>7}  {ratio:>6.3f}  {'ok' if ratio <= 1.05 else 'MISSED':>6}  {ms(with_link):>10}  "
                  f"{span / with_link:>6.3f}  {ms(timed):>8}  {span / timed:>6.3f}")
            if name == "zb_h1":
                print(f"{'  vs split-W ideal':<34}{m:>3}  {ms(span):>11}  {ms(idl['split']):>8}  "
                      f"{span / idl['split']:>6.3f}  (the paper's nominal ideal: rank 0 splits too)")
    print("   nominal cost model: " + "; ".join(f"{n} {ideal_by_m[MS[0]][n]['model']}" for n, _ in SCHEDULES))
    kinds = ("F", "B", "Bi", "W") if BLOCKS == "fused" else ("F", "B", "Bi")
    fused_note = "; fused blocks: Bi and W as SplitBackward's input_grad and weight_grad" if BLOCKS == "fused" else ""
    print(f"   model cost per action, ms, per rank s0/s1/s2/s3 (F forward, B backward, Bi its input half{fused_note}):")
    for per in sorted(cal[0], reverse=True):
        cells = "  ".join(f"{a} " + "/".join(f"{c[per][a] * 1e3:.2f}" for c in cal) for a in kinds)
        print(f"     {per} block(s) per chunk: {cells}   (nominal F {per * TF * 1e3:.0f}, B {per * TB * 1e3:.0f})")
    if BLOCKS == "fused":
        print("   fused blocks: the nominal split (B the whole fused backward, W nothing) costs what the textbook "
              "schedule does;\n   a W that re-runs the fused backward (B could not leave it the weight half) "
              "shows as measured/nominal > model's.")
    else:
        print("   zb_h1: B runs the input-gradient half of each block's backward, W the weight half (pipeline/zb.py);\n"
              "   rank 0 has no input gradient, so its W is its whole backward. The split-W row is the paper's ideal,\n"
              "   where rank 0 splits too (simulate()'s convention).")

    print("\n   evidence, per rank per step (median): slept ms / schedule's busy ms, block backward calls:")
    for m in MS:
        for name, _ in SCHEDULES:
            pr = get(("ours", name, m))
            sl, nb = stat(pr, "sleep"), stat(pr, "n_b")
            busy = ideal_by_m[m][name]["busy"]
            cells = "  ".join(f"s{r} {sl[r] * 1e3:5.0f}/{busy[r] * 1e3:4.0f} {int(nb[r]):>2} bwd" for r in range(P))
            print(f"   {name:<23}{m:>3}  {cells}")

    print("\n   where a step's time goes on each rank s0/s1/s2/s3 (median over steps, ms):")
    print("     lightning = on_train_batch_start..end minus our train_step (hooks, optimizer, merge_grads);")
    print("     python = train_step minus sleep, send, recv, wait, publish (executor + user training_step code);")
    print("     blocked = recv + final Mailbox.wait + _publish (bubble, link latency, the log broadcast)")
    for m in MS:
        for name, _ in SCHEDULES:
            pr = get(("ours_timed", name, m))
            rows = {"lightning": [], "python": [], "send": [], "blocked": []}
            for r in pr:
                st = [r["stats"][i] for i in _measured(pr)]
                t = [r["end"][i] - r["start"][i] for i in _measured(pr)]
                med = lambda f: statistics.median(f(x, dt) for x, dt in zip(st, t)) * 1e3  # noqa: E731
                rows["lightning"].append(med(lambda x, dt: dt - x["train_step"]))
                rows["python"].append(med(lambda x, dt: x["train_step"] - x["sleep"] - x["send"] - x["recv"]
                                          - x["wait"] - x["publish"]))
                rows["send"].append(med(lambda x, dt: x["send"]))
                rows["blocked"].append(med(lambda x, dt: x["recv"] + x["wait"] + x["publish"]))
            cells = "  ".join(f"{k} {'/'.join(f'{v:.1f}' for v in vals)}" for k, vals in rows.items())
            print(f"   {name:<23}{m:>3}  {cells}")

    # ---- 2. ours vs torch
    print("\n2) Throughput: ours (Lightning Trainer + MegaStrategy) vs torch.distributed.pipelining on the same blocks and m,\n"
          "   run two ways: in a plain loop, and inside the same Lightning Trainer (a LightningModule holding the rank's\n"
          "   stages, manual optimization, the loss logged on the last stage: what a Lightning user would write)")
    print("   ms/step = median over measured steps of the time between consecutive step ends (slowest rank); torch's "
          "ranks\n   are not re-synchronised at step end, so its per-step span is not comparable and only the period "
          "is used")
    print("   per round: the throughput ratio within each of the rounds (min-max): what the box's load alone moves")
    print("   work span = first block's work on any rank to the last block's (median): the pipeline alone; the rest\n"
          "   of a period is the step boundary (optimizer step, hooks, self.log, data fetch; in Lightning also its\n"
          "   per-step SIGTERM broadcast from rank 0); period/model ideal: each executor's period over the model ideal\n"
          "   of 1), i.e. what the same link and Lightning cost torch's schedules on this box too")
    hdr = (f"{'schedule':<34}{'m':>3}  {'torch class':<24}{'loop':<10}{'ours ms/step':>12}  {'torch ms/step':>13}  "
           f"{'ours/torch thr':>14}  {'target':>6}  {'work span ours/torch ms':>23}  {'ratio':>6}  "
           f"{'boundary ours/torch ms':>22}  {'period/model ideal ours/torch':>29}  {'per round':>17}")
    print(hdr)
    print("-" * len(hdr))
    compared = [(name, parts(name)[0]) for name, _ in SCHEDULES if parts(name)[0] in TORCH]
    for m in MS:
        for name, base in compared:  # ours "+split" against the same torch runs as its schedule's
            cls = TORCH[base]
            if not torch_runs(base, m):
                print(f"{label(name):<34}{m:>3}  {cls:<24}(torch refuses this m: it needs m divisible by max(1, m // {P}))")
                continue
            o_period = measured[(name, m)][1]
            o_span = work_spans(get(("ours", name, m)))
            for impl, loop in (("torch", "plain"), ("torch_lightning", "Lightning")):
                t_period = steps_of(get((impl, base, m)))[1]
                ratio = t_period / o_period
                t_span = work_spans(get((impl, base, m)))
                rounds = round_ratios(get(("ours", name, m)), get((impl, base, m)))
                print(f"{label(name):<34}{m:>3}  {cls:<24}{loop:<10}{ms(o_period):>12}  {ms(t_period):>13}  {ratio:>14.3f}  "
                      f"{'ok' if ratio >= 1.0 else 'MISSED':>6}  {ms(o_span) + ' / ' + ms(t_span):>23}  "
                      f"{t_span / o_span:>6.3f}  {ms(o_period - o_span) + ' / ' + ms(t_period - t_span):>22}  "
                      f"{o_period / models[(name, m)]:>14.3f} / {t_period / models[(base, m)]:.3f}  "
                      f"{min(rounds):>8.3f}-{max(rounds):.3f}")

    if ("1f1b", 1) in SCHEDULES:
        print(f"   per transfer on 1F1B's critical path, m={MS[0]} (a receiver waiting for it): from the sender's last "
              f"block's end\n   to the receiver's first block's start, median ms, forward / backward:  " +
              ";  ".join(f"{label} {f * 1e3:.2f} / {b * 1e3:.2f}" for label, (f, b) in
                         (("ours", exposures(get(("ours", "1f1b", MS[0])), "1f1b", MS[0])),
                          ("torch plain", exposures(get(("torch", "1f1b", MS[0])), "1f1b", MS[0])),
                          ("torch in Lightning", exposures(get(("torch_lightning", "1f1b", MS[0])), "1f1b", MS[0])))))

    # ---- 3. memory
    m = MS[0]
    print(f"\n3) Peak live saved activations per stage, m={m} (max over measured steps), in units of one microbatch's "
          f"saved\n   activations of one virtual stage ({N_BLOCKS // P} x {ACT_BYTES // 1024} KiB for v=1, "
          f"{ACT_BYTES // 1024} KiB for a v=2 chunk). live = forward done, first backward not yet\n   run (counted "
          f"by the block's autograd Function); resident = still held by autograd (saved-tensor hooks);\n   "
          f"exp = simulate()'s peak_inflight for the schedule")
    hdr = f"{'run':<46}" + "".join(f"{'stage ' + str(s):>15}" for s in range(P))
    print(hdr)
    print("-" * len(hdr))

    def mem_row(label, per_rank, field, unit, expected):
        peaks = stat(per_rank, field, max)
        print(f"{label:<46}" + "".join(f"{p / unit:>6.1f} (exp {e:>2})" for p, e in zip(peaks, expected)))
        left = stat(per_rank, "leftover", max)
        if field == "inflight_peak" and any(left):
            print(f"   !! {label}: {left} bytes still counted live at step end")

    for name, v in SCHEDULES:
        unit = ACT_BYTES * N_BLOCKS // (P * v)
        exp = ideal_by_m[m][name]["peak"]
        mem_row(f"ours {name} live", get(("ours", name, m)), "inflight_peak", unit, exp)
        if splits(name):  # ZB-H1 defers W (p graphs everywhere); "+split" runs it at once (as live)
            mem_row(f"ours {name} resident (until W)", get(("ours", name, m)), "resident_peak", unit,
                    [P] * P if name == "zb_h1" else exp)
    for name, cls in TORCH.items():
        if not torch_runs(name, m):
            continue
        unit = ACT_BYTES * N_BLOCKS // (P * (2 if name == "interleaved_1f1b" else 1))
        mem_row(f"torch {cls} live", get(("torch", name, m)), "inflight_peak", unit, ideal_by_m[m][name]["peak"])
    print(f"   zb_h1 resident: p - s graphs in flight plus s deferred W keep p graphs on every stage (exp {P}), "
          f"as in the paper")
    print(f"   sent tensors our Mailbox still holds, peak, in {ACT_BYTES // 1024} KiB transfers (gloo: until a receive "
          f"proves them landed,\n   pipeline/landed.py; exp: that rule replayed on the schedule); the executor's own "
          f"buffers (outputs until B, inputs\n   until SEND_B) are not counted here:")
    for name, v in SCHEDULES:
        peaks = stat(get(("ours_timed", name, m)), "mailbox_peak", max)
        exp = held_by_rule(ideal_by_m[m][name]["sched"])
        print(f"{'ours ' + name + ' Mailbox':<46}" + "".join(f"{p / ACT_BYTES:>6.1f} (exp {e:>2})"
                                                             for p, e in zip(peaks, exp)))
    if ("gpipe", 1) in SCHEDULES and ("1f1b", 1) in SCHEDULES:
        gp = stat(get(("ours", "gpipe", m)), "inflight_peak", max)
        ob = stat(get(("ours", "1f1b", m)), "inflight_peak", max)
        print("   GPipe vs 1F1B peak bytes: " + ", ".join(f"s{s} {gp[s] // 1024}/{ob[s] // 1024} KiB "
                                                        f"({gp[s] / ob[s]:.1f}x)" for s in range(P)))

    # ---- probes
    print("\n4) Isolated costs in the same processes (gloo on this CPU box, 64x256 fp32 payload, ping-pong ranks 0-1):")
    print(f"   one-way transfer: plain isend/irecv {probe['plain_one_way_ms']:.3f} ms;  our Mailbox.send/recv "
          f"(a fresh one: header message, then payload) {probe['mailbox_one_way_ms']:.3f} ms")
    print(f"   sender-side call: dist.isend {probe['plain_send_call_ms']:.3f} ms;  Mailbox.send (builds the header, "
          f"2 isends) {probe['mailbox_send_call_ms']:.3f} ms")
    print(f"   a broadcast over 4 ranks of one float64 tensor (how the step's loss and logs travel on NCCL; on gloo "
          f"they are\n   sent to receives posted at step start): {probe['log_broadcast_ms']:.3f} ms")
    side_by_side(get, measured, models, ideal_by_m)


def side_by_side(get, measured, models, ideal_by_m):
    """5) Per schedule torch has: our default (split_backward="auto", i.e. "+drain" at pp>1), our textbook
    schedule (split_backward=False) and torch's, as step TIME ratios (ours/torch > 1: ours slower)."""
    ms = lambda x: f"{x * 1e3:.1f}"  # noqa: E731
    rows = [(base, m) for m in MS for base in TORCH if (base, dict(SCHEDULES).get(base)) in SCHEDULES
            and (base + "+drain", dict(SCHEDULES)[base]) in SCHEDULES and torch_runs(base, m)]
    if not rows:
        return
    print(f"\n5) Side by side ({'FUSED' if BLOCKS == 'fused' else 'split'} blocks): ms/step = period as in 2); "
          f"time ratios (ours/torch > 1: ours slower;\n   the inverse of 2)'s throughput ratio); /nominal and /model: "
          f"the step's span over 1)'s ideals")
    hdr = (f"{'schedule':<18}{'m':>3}  {'default ms':>10}  {'textbook ms':>11}  {'torch ms':>8}  "
           f"{'default/torch':>13}  {'textbook/torch':>14}  {'default/textbook':>16}  "
           f"{'default /nominal /model':>23}  {'textbook /nominal /model':>24}  {'torch in L ms':>13}")
    print(hdr)
    print("-" * len(hdr))
    for base, m in rows:
        d, t = measured[(base + "+drain", m)], measured[(base, m)]
        tp = steps_of(get(("torch", base, m)))[1]
        tl = steps_of(get(("torch_lightning", base, m)))[1]

        def vs(name, span):
            return f"{span / ideal_by_m[m][name]['ideal']:.3f} / {span / models[(name, m)]:.3f}"
        print(f"{base:<18}{m:>3}  {ms(d[1]):>10}  {ms(t[1]):>11}  {ms(tp):>8}  {d[1] / tp:>13.3f}  {t[1] / tp:>14.3f}  "
              f"{d[1] / t[1]:>16.3f}  {vs(base + '+drain', d[0]):>23}  {vs(base, t[0]):>24}  {ms(tl):>13}")


def main():
    global TF, TB, MS, BLOCKS, ROUNDS, WARMUP, MEASURED
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--block-ms", type=float, default=TF * 1e3,
                        help="forward cost of one block in ms (backward: twice that); the executor's cost per "
                             "transfer is fixed, so its share of a step shrinks as blocks get longer")
    parser.add_argument("--microbatches", default=",".join(map(str, MS)),
                        help="comma-separated microbatch counts to run, e.g. 6,8 (any m: ours groups interleaved "
                             "1F1B's microbatches by at least p; the first one is used for the memory table)")
    parser.add_argument("--also", default="",
                        help="comma-separated schedules to run besides the default set, e.g. 1f1b+split,"
                             "interleaved_1f1b+split (split_backward=True: every backward split)")
    parser.add_argument("--blocks", choices=("split", "fused"), default="split",
                        help="split: half of each block's backward on the weight's own branch (a split backward "
                             "defers it for free); fused: each block's backward one custom autograd.Function "
                             "returning both gradients (as flash attention, fused kernels), run on 1F1B and "
                             "interleaved 1F1B, default and textbook, next to torch's")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="times every run is repeated, interleaved")
    parser.add_argument("--smoke", action="store_true", help="a tiny model, one round, a few steps: the path, no figures")
    args = parser.parse_args()
    if args.smoke:  # 1 ms blocks, m=4, one round, 1 + 2 steps a run
        args.block_ms, args.microbatches, args.rounds, WARMUP, MEASURED = 1.0, "4", 1, 1, 2
    MS = tuple(int(x) for x in args.microbatches.split(","))
    BLOCKS, ROUNDS = args.blocks, args.rounds
    if BLOCKS == "fused":
        SCHEDULES[:] = FUSED_SCHEDULES
    for name in filter(None, args.also.split(",")):
        if parts(name)[0] not in ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1"):
            parser.error(f"--also: unknown schedule {name!r}")
        SCHEDULES.append((name, 2 if name.startswith("interleaved") else 1))
    TF = args.block_ms / 1e3
    TB = 2 * TF
    t0 = time.perf_counter()
    header()
    load0 = os.getloadavg()[0]
    results = measure()
    report(results)
    print(f"\nwall time: {time.perf_counter() - t0:.0f} s; 1-min load average at start {load0:.1f}, at end "
          f"{os.getloadavg()[0]:.1f} (on {os.cpu_count()} cores; the benchmark's own 4 processes mostly sleep)")


if __name__ == "__main__":
    main()
