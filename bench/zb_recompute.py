"""Zero bubble with activation checkpointing: what one recomputation for both backward halves saves.

A stage of the example GPT's blocks (a later stage: its input needs a gradient, so ZB-H1's B and W
both run), one microbatch at a time: forward, B (the input gradient), W (the weight gradients), as
the pipeline executor runs them (pipeline/zb.py). Timed side by side in alternating rounds, as a
ratio to the same split backward without recomputation:

- ``torch checkpoint``: torch.utils.checkpoint (non-reentrant), what a 1F1B stage uses; under the
  split it recomputes each block in B and again in W;
- ``zb checkpoint``: pipeline/zb_checkpoint.py, recomputing once in B, its graph reused by W.

A recomputation costs about one forward; a forward is about a third of forward + backward, so
expect about 1.33 for one and 1.67 for two. Also printed: the memory a microbatch holds after its
forward (until B) and after its B (until W, the part ZB-H1 defers), read as the process's resident
set (large allocations are mmapped and returned at free: MALLOC_MMAP_THRESHOLD_ is set for that).

    .venv/bin/python bench/zb_recompute.py [--layers 4] [--width 256]
"""

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

if "MALLOC_MMAP_THRESHOLD_" not in os.environ and __name__ == "__main__":  # see above; before the imports below
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(1 << 16)
    os.execv(sys.executable, [sys.executable] + sys.argv)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from examples.gpt.model import Block, GPTConfig  # noqa: E402
from lightning_tp.recompute import full as recompute  # noqa: E402
from lightning_tp.pipeline.run.zb import SplitBackward  # noqa: E402

ROUNDS, REPS, WARMUP = 5, 6, 2
MODES = ("no recompute", "torch checkpoint", "zb checkpoint")


def stage(mode: str, layers: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    blocks = nn.Sequential(*(Block(GPTConfig(n_embd=width, n_head=4, block_size=128)) for _ in range(layers)))
    if mode != "no recompute":
        recompute.apply(blocks, [("", i) for i in range(layers)], split=mode == "zb checkpoint")
    return blocks


def step(blocks: nn.Module, x0: torch.Tensor, g: torch.Tensor) -> float:
    t0 = time.perf_counter()
    x = x0.clone().requires_grad_()
    split = SplitBackward(blocks(x), g, x, list(blocks.parameters()))
    split.input_grad()
    split.weight_grad()
    return time.perf_counter() - t0


def resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def held(blocks: nn.Module, x0: torch.Tensor, g: torch.Tensor) -> tuple:
    """Bytes held (resident set growth) after the forward and after B, the input's gradient dropped."""
    gc.collect()
    base = resident()
    x = x0.clone().requires_grad_()
    split = SplitBackward(blocks(x), g, x, list(blocks.parameters()))
    after_f = resident() - base
    grad = split.input_grad()
    del grad
    gc.collect()
    after_b = resident() - base
    split.weight_grad()
    return after_f, after_b


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--smoke", action="store_true", help="a tiny model, one round, a few steps: the path, no figures")
    args = parser.parse_args()
    rounds, reps = ROUNDS, REPS
    if args.smoke:
        args.layers, args.width, args.batch, args.seq, rounds, reps = 1, 32, 2, 16, 1, 1
    stages = {mode: stage(mode, args.layers, args.width) for mode in MODES}
    x0, g = torch.randn(args.batch, args.seq, args.width), torch.randn(args.batch, args.seq, args.width)
    times = {mode: [] for mode in MODES}
    for _ in range(rounds):
        for mode in MODES:
            for i in range(WARMUP + reps):
                dt = step(stages[mode], x0, g)
                if i >= WARMUP:
                    times[mode].append(dt)
    memory = {mode: held(stages[mode], x0, g) for mode in MODES}
    base = statistics.median(times["no recompute"])
    print(f"{args.layers} blocks of width {args.width}, microbatch {args.batch} x {args.seq}; "
          f"forward + B + W, median of {rounds * reps}:")
    for mode in MODES:
        f, b = (n / 2**20 for n in memory[mode])
        print(f"  {mode:17s} {statistics.median(times[mode]) * 1e3:8.1f} ms   x{statistics.median(times[mode]) / base:.3f}"
              f"   held after F {f:6.1f} MiB, after B {b:6.1f} MiB")


if __name__ == "__main__":
    main()
