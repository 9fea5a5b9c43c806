"""A measured pipeline timeline beside the predicted one (CPU, gloo): the example GPT trained under
MegaStrategy(pp, microbatches, schedule, virtual_stages) with PipelineTimeline recording one step; that
trace drawn to a PNG, and the same schedule replayed with the measured median forward and backward of a
chunk (simulate) drawn beside it; the step's measured and replayed lengths printed as a ratio.

    .venv/bin/python bench/timeline.py [--pp 4] [--v 2] [--m 8] [--out docs/images]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lightning_tp.testing import run_local  # noqa: E402

STEP = 3  # the recorded step (after warm-up)


def work(rank, world, pp, v, m, path, width=256):
    import warnings

    import lightning as L
    import torch.distributed as torch_dist

    from examples.gpt.lit import LitGPT, ShakespeareData
    from lightning_tp import MegaStrategy, PipelineTimeline

    warnings.filterwarnings("ignore")
    torch_dist.init_process_group("gloo")
    schedule = "interleaved_1f1b" if v > 1 else "1f1b"
    trainer = L.Trainer(accelerator="cpu", devices=world, max_steps=STEP + 1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        strategy=MegaStrategy(pp=pp, microbatches=m, schedule=schedule, virtual_stages=v,
                                              split_backward=False, timeout=300),
                        callbacks=[PipelineTimeline(path, steps=(STEP,))])
    trainer.fit(LitGPT(n_layer=2 * pp * v, n_head=4, n_embd=width, block_size=64),
                ShakespeareData(block_size=64, batch_size=2 * m))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--v", type=int, default=2)
    parser.add_argument("--m", type=int, default=8)
    parser.add_argument("--out", default=None, help="folder for trace.json and the two PNGs (default: a temp dir)")
    parser.add_argument("--smoke", action="store_true", help="a tiny model, one round, a few steps: the path, no figures")
    args = parser.parse_args()
    if args.smoke:
        args.pp, args.v, args.m = 2, 2, 2
    width = 32 if args.smoke else 256
    from lightning_tp.pipeline.schedule.schedules import build_schedule
    from lightning_tp.pipeline.schedule.simulate import simulate
    from lightning_tp.layout_search import trace_png
    from lightning_tp.layout_search.picture import draw, schedule_rows

    out = Path(args.out or tempfile.mkdtemp())
    out.mkdir(parents=True, exist_ok=True)
    trace = out / f"measured_pp{args.pp}_v{args.v}.json"
    run_local(args.pp, work, args.pp, args.v, args.m, str(trace), width, timeout=900)
    trace_png(trace, out / f"measured_pp{args.pp}_v{args.v}.png")
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X" and e["tid"] == 0]
    f = statistics.median(e["dur"] for e in events if e["name"] == "F")
    b = statistics.median(e["dur"] for e in events if e["name"] == "B")
    schedule = "interleaved_1f1b" if args.v > 1 else "1f1b"
    replay = simulate(build_schedule(schedule, args.pp, args.m, args.v), args.pp, args.v, {"F": f, "B": b})
    draw(schedule_rows(replay), out / f"predicted_pp{args.pp}_v{args.v}.png")
    measured = max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)
    print(f"pp={args.pp} v={args.v} m={args.m} on {os.cpu_count()} cores: chunk forward {f / 1e3:.1f} ms, backward "
          f"{b / 1e3:.1f} ms (medians); step measured {measured / 1e3:.1f} ms, replayed {replay.makespan / 1e3:.1f} ms, "
          f"measured/replayed {measured / replay.makespan:.3f}; bubble in the replay {replay.bubble_fraction:.1%}")
    print(f"files in {out}")


if __name__ == "__main__":
    main()
