"""Step-time overhead of MegaStrategy(tp=1, pp=1) against Lightning's single-device strategy.

Both train the example GPT in this one process, in alternating rounds, so machine noise hits both
alike; the figure is the ratio of median step times (target <= 1.03).
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
from lightning_tp.layout_search.calibrate import step_times as step_timer  # noqa: E402

STEPS, WARMUP, ROUNDS = 40, 5, 3


def step_times(strategy, steps: int = STEPS, width: int = 128, seq: int = 64) -> list:
    L.seed_everything(0, verbose=False)
    timer = step_timer()
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=steps, callbacks=[timer],
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0)
    trainer.fit(LitGPT(n_layer=4, n_embd=width, block_size=seq), ShakespeareData(block_size=seq, batch_size=16))
    return timer.times[WARMUP:]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny model, one round, a few steps: the path, no figures")
    args = parser.parse_args()
    sizes = dict(steps=WARMUP + 2, width=32, seq=16) if args.smoke else {}
    torch.set_num_threads(1)
    single, mega = [], []
    for _ in range(1 if args.smoke else ROUNDS):
        single += step_times("auto", **sizes)
        mega += step_times(MegaStrategy(tp=1, pp=1), **sizes)
    s, m = statistics.median(single), statistics.median(mega)
    print(f"median step: single-device {s * 1e3:.2f} ms, MegaStrategy(tp=1,pp=1) {m * 1e3:.2f} ms")
    print(f"overhead ratio (mega / single): {m / s:.3f}   (target <= 1.03)")


if __name__ == "__main__":
    main()
