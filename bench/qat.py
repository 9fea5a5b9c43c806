"""PTQ vs QAT on the example GPT (CPU, a few minutes): validation loss for fp32, W8A8 and W4A8.

    .venv/bin/python bench/qat.py [--steps 300] [--qat-steps 150] [--act-range ema]

1. Train LitGPT (n_layer=2, n_embd=128) on the Shakespeare bytes for ``--steps`` steps in fp32.
2. PTQ: copy it, ``apply_qat`` + ``calibrate`` on a few training batches (no training).
3. QAT: copy the PTQ model (calibrated ranges as the start), fine-tune ``--qat-steps`` with fake
   quant and a lower learning rate; then ``convert`` it to int8 layers (torch._int_mm) and evaluate.
4. Control: the fp32 model fine-tuned for the same steps at the same learning rate, so extra
   training alone is not mistaken for what quantization-aware training recovers.

"gap closed" = (PTQ - QAT) / (PTQ - fp32): the fraction of the PTQ loss increase QAT removes,
measured against the fp32 model both started from. Every number is measured on this run.
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning as L  # noqa: E402

from examples.gpt.lit import LitGPT, ShakespeareData  # noqa: E402
from lightning_tp.quant import apply_qat, calibrate, convert  # noqa: E402


def fit(lit: L.LightningModule, data, steps: int, seed: int) -> float:
    L.seed_everything(seed, verbose=False)
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        num_sanity_val_steps=0)
    start = time.perf_counter()
    trainer.fit(lit, datamodule=data)
    return time.perf_counter() - start


@torch.no_grad()
def val_loss(lit: LitGPT, data) -> float:
    lit.eval()
    losses = [lit.model(x, y)[1].item() for x, y in data.val_dataloader()]
    return sum(losses) / len(losses)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300, help="fp32 training steps")
    ap.add_argument("--qat-steps", type=int, default=150, help="QAT (and fp32 control) fine-tuning steps")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--qat-lr", type=float, default=1e-3)
    ap.add_argument("--calib-batches", type=int, default=8)
    ap.add_argument("--act-range", default="ema", choices=["ema", "learned"])
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)

    data = ShakespeareData(block_size=64, batch_size=16)
    data.setup()
    L.seed_everything(args.seed, verbose=False)
    base = LitGPT(n_layer=args.n_layer, n_embd=args.n_embd, n_head=4, lr=args.lr)
    t_fp32 = fit(base, data, args.steps, args.seed)
    calib = []
    gen = torch.Generator().manual_seed(args.seed)
    for i in torch.randperm(len(data.train_set), generator=gen)[: 16 * args.calib_batches].split(16):
        xs, ys = zip(*(data.train_set[int(j)] for j in i))
        calib.append((torch.stack(xs), torch.stack(ys)))

    rows = {"fp32": val_loss(base, data)}
    control = copy.deepcopy(base)
    control.hparams.lr = args.qat_lr
    fit(control, data, args.qat_steps, args.seed + 1)
    rows["fp32 +ft (control)"] = val_loss(control, data)
    times = {}
    for mode in ("int8", "w4a8"):
        ptq = copy.deepcopy(base)
        apply_qat(ptq.model, mode, act_range=args.act_range)
        calibrate(ptq.model, calib)
        rows[f"{mode} PTQ"] = val_loss(ptq, data)
        qat = copy.deepcopy(ptq)
        qat.hparams.lr = args.qat_lr
        times[mode] = fit(qat, data, args.qat_steps, args.seed + 1)
        rows[f"{mode} QAT"] = val_loss(qat, data)
        convert(ptq.model)
        rows[f"{mode} PTQ int8"] = val_loss(ptq, data)
        convert(qat.model)
        rows[f"{mode} QAT int8"] = val_loss(qat, data)

    fp = rows["fp32"]
    print(f"\nLitGPT n_layer={args.n_layer} n_embd={args.n_embd}: fp32 {args.steps} steps ({t_fp32:.0f} s), "
          f"QAT/control fine-tune {args.qat_steps} steps at lr {args.qat_lr}, act range {args.act_range!r}, "
          f"PTQ calibrated on {args.calib_batches} batches; val = {len(data.val_dataloader())} batches x 16 x 64")
    print(f"{'model':<22}{'val loss':>10}{'vs fp32':>10}")
    for name, v in rows.items():
        print(f"{name:<22}{v:>10.4f}{v - fp:>+10.4f}")
    print()
    for mode in ("int8", "w4a8"):
        ptq, qat = rows[f"{mode} PTQ"], rows[f"{mode} QAT"]
        gap = ptq - fp
        closed = (ptq - qat) / gap if gap > 0 else float("nan")
        print(f"{mode}: PTQ gap {gap:+.4f}, QAT gap {qat - fp:+.4f} -> QAT closes {closed:.0%} of the PTQ gap "
              f"({times[mode]:.0f} s of QAT)")
    ctrl = rows["fp32 +ft (control)"]
    print(f"control: fp32 fine-tuned the same steps moves {ctrl - fp:+.4f}; W4A8 QAT vs that control: "
          f"{rows['w4a8 QAT'] - ctrl:+.4f}")


if __name__ == "__main__":
    main()
