"""The planner's step time against measured CPU runs: this machine calibrated (layout_search.calibrate: GEMM rate and
curve, memory bandwidth, gloo latency and bandwidth, loop overheads) and, with --timed (default), the model's
own blocks timed at each tp's shapes (layout_search.timing); then the example GPT trained under each layout by a
Lightning Trainer (fp32, global batch 16 x 64), the layouts of one process count side by side in rounds (the
order rotated each round), each step time the median after warm-up, the median over rounds; beside the
planner's estimate of the same layout: the ratio per layout and the rank correlation.

    .venv/bin/python bench/plan_cpu.py [--width 256] [--layers 4] [--steps 12] [--rounds 3] [--flops] [--experts 4]

--experts N: the example's mixture-of-experts GPT (N experts, 2 a token) instead, with ep=2 layouts added.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import lightning as L  # noqa: E402
import torch  # noqa: E402

from lightning_tp.testing import run_local  # noqa: E402

SEQ, BATCH, WARMUP = 64, 16, 3
PP2 = dict(pp=2, split_backward=False)
# name: (world, MegaStrategy kwargs)
LAYOUTS = {
    "one process": (1, {}),
    "dp2": (2, {}),
    "dp2 zero1": (2, dict(zero=1)),
    "dp2 full recompute": (2, dict(activation_checkpointing=True)),
    "tp2": (2, dict(tp=2)),
    "tp2 sp": (2, dict(tp=2, sp=True)),
    "tp2 full recompute": (2, dict(tp=2, activation_checkpointing=True)),
    "pp2 m2": (2, dict(PP2, microbatches=2)),
    "pp2 m4": (2, dict(PP2, microbatches=4)),
    "pp2 m8": (2, dict(PP2, microbatches=8)),
    "pp2 m4 interleaved": (2, dict(PP2, microbatches=4, schedule="interleaved_1f1b", virtual_stages=2)),
    "pp2 m4 full recompute": (2, dict(PP2, microbatches=4, activation_checkpointing=True)),
}
EP_LAYOUTS = {"dp2 ep2": (2, dict(ep=2)), "dp2 ep2 zero1": (2, dict(ep=2, zero=1))}


def measure(rank, world, names, width, layers, steps, rounds, experts):
    import warnings

    import torch.distributed as torch_dist

    from examples.gpt.lit import LitGPT, ShakespeareData
    from lightning_tp import MegaStrategy
    from lightning_tp.layout_search.calibrate import step_times

    warnings.filterwarnings("ignore")
    if world > 1:
        torch_dist.init_process_group("gloo")
    out = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            _, kw = {**LAYOUTS, **EP_LAYOUTS}[name]
            dp = world // (kw.get("tp", 1) * kw.get("pp", 1))
            probe = step_times()
            L.seed_everything(0, verbose=False)
            trainer = L.Trainer(accelerator="cpu", devices=world, max_steps=steps, logger=False,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                limit_val_batches=0, strategy=MegaStrategy(**kw, timeout=300), callbacks=[probe])
            trainer.fit(LitGPT(n_layer=layers, n_head=4, n_embd=width, block_size=SEQ, n_expert=experts),
                        ShakespeareData(block_size=SEQ, batch_size=BATCH // dp))
            out[name].append(statistics.median(probe.times[WARMUP:]))
    return {name: statistics.median(times) for name, times in out.items()}


def predict(name, ranking):
    world, kw = LAYOUTS[name]
    tp, pp = kw.get("tp", 1), kw.get("pp", 1)
    dp = world // (tp * pp)
    m = kw.get("microbatches", 1)
    want = (tp, pp, dp, kw.get("sp", False), BATCH // dp // m, m, kw.get("schedule", "1f1b"),
            kw.get("virtual_stages", 1), kw.get("activation_checkpointing", False), kw.get("zero", 0), kw.get("ep", 1))
    return next(c for c in ranking.fits + ranking.overflows if (
        c.tp, c.pp, c.dp, c.sp, c.microbatch_size, c.microbatches, c.schedule, c.virtual_stages,
        c.activation_checkpointing, c.zero, c.ep) == want)


def spearman(xs, ys) -> float:
    rank = lambda v: {i: r for r, i in enumerate(sorted(range(len(v)), key=lambda i: v[i]))}  # noqa: E731
    rx, ry = rank(xs), rank(ys)
    n = len(xs)
    if n < 2:  # --smoke: one layout, no order to compare
        return float("nan")
    return 1 - 6 * sum((rx[i] - ry[i]) ** 2 for i in range(n)) / (n * (n * n - 1))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--flops", action="store_true", help="compute from FLOP rates, not the blocks timed here")
    parser.add_argument("--experts", type=int, default=0, help="a mixture-of-experts GPT (and ep=2 layouts)")
    parser.add_argument("--smoke", action="store_true", help="a tiny model, one round, a few steps: the path, no figures")
    args = parser.parse_args()
    worlds = (1, 2)
    if args.experts:
        LAYOUTS.update(EP_LAYOUTS)
    if args.smoke:  # one process: its layouts only (a GPT of 3 layers, the planner's least, width 32)
        args.width, args.layers, args.steps, args.rounds, args.flops, worlds = 32, 3, WARMUP + 1, 1, True, (1,)
        for name in [n for n, (w, _) in LAYOUTS.items() if w not in worlds]:
            del LAYOUTS[name]
    from examples.gpt.model import GPT, GPTConfig
    from lightning_tp.layout_search import plan
    from lightning_tp.layout_search.calibrate import calibrate

    clusters = {w: calibrate(w) for w in worlds}
    print("calibrated:", {w: (round(c.peak_tflops * 1e3), round(c.gemm_half_gflop, 4), round(c.hbm_gbps),
                              round(c.intra_node_gbps, 1), round(c.latency_us), round(c.compute_slowdown, 2),
                              round(c.optimizer_s_per_param * 1e9, 2)) for w, c in clusters.items()},
          "(GFLOP/s, half GFLOP, memory Gbit/s, gloo Gbit/s, latency us, compute slowdown, AdamW ns/param)")
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=args.layers, n_head=4, n_embd=args.width, block_size=SEQ, n_expert=args.experts))
    rankings = {w: plan(model, gpus=w, cluster=clusters[w], global_batch=BATCH, seq_len=SEQ, precision="32-true",
                        zeros=(0, 1), timed=not args.flops) for w in worlds}
    measured = {}
    for world in worlds:
        names = [n for n, (w, _) in LAYOUTS.items() if w == world]
        measured.update(run_local(world, measure, names, args.width, args.layers, args.steps, args.rounds,
                                 args.experts, timeout=3600)[0])
    print(f"\n{'layout':24} {'measured ms':>12} {'predicted ms':>13} {'ratio':>7}   predicted parts (ms)")
    pred = {}
    for name, (world, _) in LAYOUTS.items():
        c = predict(name, rankings[world])
        pred[name] = c.step_s
        parts = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in c.why.items() if v > 5e-4)
        print(f"{name:24} {measured[name] * 1e3:12.1f} {pred[name] * 1e3:13.1f} {pred[name] / measured[name]:7.3f}   {parts}")
    names = list(LAYOUTS)
    worst = max(abs(pred[n] / measured[n] - 1) for n in names)
    print(f"\nlargest deviation {worst:.1%} (target 15%); rank correlation (Spearman) "
          f"{spearman([measured[n] for n in names], [pred[n] for n in names]):.3f} (target 0.8)")


if __name__ == "__main__":
    main()
