"""What a checkpoint costs the training, sync against async, in one run (CPU, gloo, tp=2 on 2 processes):
the time a save blocks the step, the time an asynchronous write takes behind it, both in steps of the
measured step time, and the checkpoint interval that balances them against work lost to failures (Young:
interval = sqrt(2 x save cost x mean time between failures)). The example GPT, AdamW, the Shakespeare bytes.

    .venv/bin/python bench/checkpoint_save.py [--layers 8] [--width 512] [--steps 6] [--rounds 3] [--smoke]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import lightning as L  # noqa: E402
import torch  # noqa: E402

from lightning_tp.testing import run_local as run  # noqa: E402


class StepTimes(L.Callback):
    def __init__(self):
        self.times, self._t = [], None

    def on_train_batch_start(self, *args):
        self._t = time.perf_counter()

    def on_train_batch_end(self, *args):
        self.times.append(time.perf_counter() - self._t)


def _fits(rank, world, args):
    """Each round: a fit per mode, then a save after it (sync: until written; async: until it returns, and until
    the write is in place). Returns {mode: [(step s, blocked s, written s)]}."""
    from examples.gpt.lit import LitGPT, ShakespeareData
    from lightning_tp import MegaStrategy

    out = {"sync": [], "async": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for mode in (("sync", "async") if r % 2 == 0 else ("async", "sync")):
                L.seed_everything(0, verbose=False)
                steps = StepTimes()
                strategy = MegaStrategy(tp=2, async_save=mode == "async")
                trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=args.steps,
                                    logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                    enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                                    callbacks=[steps])
                model = LitGPT(n_layer=args.layers, n_embd=args.width, n_head=8, block_size=128)
                trainer.fit(model, ShakespeareData(block_size=128, batch_size=8))
                path = Path(trainer.strategy.broadcast(tmp)) / f"{mode}-{r}.ckpt"
                strategy.barrier()
                t0 = time.perf_counter()
                trainer.save_checkpoint(path)
                blocked = time.perf_counter() - t0
                if strategy._writer is not None:
                    strategy._writer.wait()
                strategy.barrier()
                written = time.perf_counter() - t0
                out[mode].append((statistics.median(steps.times[1:]), blocked, written))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="a tiny model, one round of 3 steps: the path, not a figure")
    args = ap.parse_args(argv)
    if args.smoke:
        args.layers, args.width, args.steps, args.rounds = 2, 64, 3, 1
    got = run(2, _fits, args, timeout=1800)
    rows = {mode: [row for rank in got for row in rank[mode]] for mode in ("sync", "async")}
    step = statistics.median(r[0] for rows_ in rows.values() for r in rows_)
    params = args.layers * 12 * args.width ** 2 + 2 * 256 * args.width + 128 * args.width
    print(f"checkpoint cost, the example GPT ({args.layers} layers x {args.width}, ~{params / 1e6:.0f}M parameters, "
          f"AdamW: ~{params * 12 / 2 ** 20:.0f} MiB saved), tp=2 on 2 processes, {args.rounds} round(s):")
    print(f"  step time (median): {step * 1e3:.0f} ms")
    cost = {}
    for mode in ("sync", "async"):
        blocked = statistics.median(r[1] for r in rows[mode])
        written = statistics.median(r[2] for r in rows[mode])
        cost[mode] = blocked
        print(f"  {mode:>5} save: blocks the step {blocked * 1e3:7.0f} ms ({blocked / step:5.2f} steps), in place after "
              f"{written * 1e3:7.0f} ms")
    print(f"  async/sync blocking: {cost['async'] / cost['sync']:.2f}")
    print("  checkpoint interval that balances save cost against work lost (Young: sqrt(2 x cost x MTBF)):")
    for hours in (1, 4, 24):
        spans = ", ".join(f"{mode} every {(2 * cost[mode] * hours * 3600) ** 0.5 / step:,.0f} steps"
                          for mode in ("sync", "async"))
        print(f"    one failure per {hours:>2} h: {spans}")


if __name__ == "__main__":
    main()
