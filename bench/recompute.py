"""Activation checkpointing: what it saves and what it costs, side by side in one process.

The example GPT trains under MegaStrategy(tp=1, pp=1) with activation_checkpointing off, True (every
block), 2 (the first two of four blocks) and "selective" (each block's attention core), in alternating
rounds so that machine noise hits all alike. --width/--heads/--seq/--dropout set the model: Megatron's
regime for selective is a large 5as/h (the core's s² activations) and a small s/6h (its FLOPs), e.g.
--width 256 --heads 16 --seq 256; attention dropout > 0 makes CPU sdpa take its math path, which keeps
the s² probabilities as eager attention does. Printed: the bytes autograd keeps from one training step's forward (distinct storages,
parameters left out), and the median step time, each as a ratio to the run without it. A full
recompute costs about one more forward of the blocks (a forward is about a third of forward +
backward), so the time ratio to expect is ~1.3 for True.
"""

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning as L  # noqa: E402
import torch  # noqa: E402

from examples.gpt.lit import LitGPT, ShakespeareData  # noqa: E402
from lightning_tp import MegaStrategy  # noqa: E402
from lightning_tp.layout_search.calibrate import step_times  # noqa: E402
from lightning_tp.layout_search.measure import saved_bytes  # noqa: E402

STEPS, WARMUP, ROUNDS = 30, 5, 3
CHOICES = (False, True, 2, "selective")


def fit(choice, steps, callback, args):
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=MegaStrategy(activation_checkpointing=choice),
                        max_steps=steps, callbacks=[callback], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    trainer.fit(LitGPT(n_layer=4, n_embd=args.width, n_head=args.heads, block_size=args.seq, dropout=args.dropout),
                ShakespeareData(block_size=args.seq, batch_size=args.batch))
    return callback


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--steps", type=int, default=STEPS, help=f"per fit; the first {WARMUP} are not timed")
    parser.add_argument("--smoke", action="store_true", help="a tiny model, one round, a few steps: the path, no figures")
    args = parser.parse_args()
    if args.smoke:
        args.width, args.heads, args.seq, args.batch, args.rounds, args.steps = 32, 2, 16, 2, 1, WARMUP + 2
    torch.set_num_threads(1)
    saved = {c: sum(fit(c, 2, saved_bytes(), args).per_step[-1].values()) for c in CHOICES}
    times = {c: [] for c in CHOICES}
    for _ in range(args.rounds):
        for c in CHOICES:
            times[c] += fit(c, args.steps, step_times(), args).times[WARMUP:]
    base_t, base_m = statistics.median(times[False]), saved[False]
    print(f"example GPT (4 blocks, width {args.width}, {args.heads} heads, batch {args.batch} x {args.seq} tokens, "
          f"dropout {args.dropout}, fp32, 1 CPU thread), MegaStrategy(tp=1, pp=1); 5as/h = "
          f"{5 * args.heads * args.seq / args.width:.0f}, s/6h = {args.seq / (6 * args.width):.2f}:")
    print(f"{'activation_checkpointing':<26}{'saved for backward':>20}{'ratio':>8}{'median step ms':>16}{'ratio':>8}")
    for c in CHOICES:
        t = statistics.median(times[c])
        print(f"{c!s:<26}{saved[c] / 2**20:>16.2f} MiB{saved[c] / base_m:>8.3f}{t * 1e3:>16.1f}{t / base_t:>8.3f}")


if __name__ == "__main__":
    main()
