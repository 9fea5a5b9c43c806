"""PTQ vs QAT on the example GPT (CPU, a few minutes): validation loss for fp32, W8A8 and W4A8.

    .venv/bin/python bench/qat.py [--steps 400] [--qat-steps 150] [--act-range ema|learned]

1. Train LitGPT's model (n_layer=2, n_embd=128) on the Shakespeare bytes (ShakespeareData) for
   ``--steps`` AdamW steps, warmup + cosine decay, in fp32.
2. PTQ: copy it, ``apply_qat`` + ``calibrate`` on a few training batches (no training).
3. QAT: copy the PTQ model (calibrated ranges as the start) and fine-tune ``--qat-steps`` with fake
   quant at a lower learning rate (cosine); then ``convert`` to int8 layers (torch._int_mm) and evaluate.
4. Control: the fp32 model fine-tuned identically (same steps, LR, batches), so what extra training
   alone changes is not credited to QAT; a second control with another batch order is the noise floor.

"QAT closes X% of the PTQ gap" is reported two ways: vs the fp32 start, (PTQ - QAT) / (PTQ - fp32),
and vs the control, 1 - (QAT - control) / (PTQ - fp32). Every number is measured on this run. A plain
training loop (not a Trainer) keeps the LR schedule and batch order identical across the runs.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from examples.gpt.lit import LitGPT, ShakespeareData  # noqa: E402
from lightning_tp.quant import apply_qat, calibrate, convert  # noqa: E402


def batches(data, seed: int):
    """Endless shuffled training batches (seeded: QAT and its fp32 control see the same ones)."""
    torch.manual_seed(seed)
    while True:
        yield from data.train_dataloader()


def train(lit: LitGPT, data, steps: int, lr: float, seed: int, warmup: int = 0) -> float:
    """AdamW (LitGPT's choice) with linear warmup and cosine decay to zero, so every phase ends
    settled and the control run isolates what fine-tuning alone changes. Returns seconds."""
    opt = torch.optim.AdamW(lit.parameters(), lr=lr, weight_decay=lit.hparams.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup if warmup else 1.0) * 0.5 * (1 + math.cos(math.pi * s / steps)))
    lit.train()
    start = time.perf_counter()
    for _, (x, y) in zip(range(steps), batches(data, seed)):
        _, loss = lit.model(x, y)
        loss.backward()
        opt.step(), sched.step(), opt.zero_grad(set_to_none=True)
    return time.perf_counter() - start


@torch.no_grad()
def val_loss(lit: LitGPT, data) -> float:
    lit.eval()
    losses = [lit.model(x, y)[1].item() for x, y in data.val_dataloader()]
    return sum(losses) / len(losses)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=400, help="fp32 training steps")
    ap.add_argument("--qat-steps", type=int, default=150, help="QAT (and fp32 control) fine-tuning steps")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--qat-lr", type=float, default=3e-4)
    ap.add_argument("--calib-batches", type=int, default=8)
    ap.add_argument("--act-range", default="ema", choices=["ema", "learned"])
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="a tiny model, one round, a few steps: the path, no figures")
    args = ap.parse_args()
    if args.smoke:
        args.steps, args.qat_steps, args.calib_batches, args.n_embd, args.n_layer = 4, 2, 1, 32, 1
    warnings.filterwarnings("ignore")

    data = ShakespeareData(block_size=64, batch_size=16)
    data.setup()
    torch.manual_seed(args.seed)
    base = LitGPT(n_layer=args.n_layer, n_embd=args.n_embd, n_head=4, lr=args.lr)
    t_fp32 = train(base, data, args.steps, args.lr, args.seed, warmup=args.steps // 10)
    calib = []
    gen = torch.Generator().manual_seed(args.seed)
    for i in torch.randperm(len(data.train_set), generator=gen)[: 16 * args.calib_batches].split(16):
        xs, ys = zip(*(data.train_set[int(j)] for j in i))
        calib.append((torch.stack(xs), torch.stack(ys)))

    rows = {"fp32": val_loss(base, data)}
    control = copy.deepcopy(base)
    train(control, data, args.qat_steps, args.qat_lr, args.seed + 1)
    rows["fp32 +ft (control)"] = val_loss(control, data)
    other = copy.deepcopy(base)  # the same fine-tune with another batch order: the noise floor
    train(other, data, args.qat_steps, args.qat_lr, args.seed + 2)
    noise = abs(val_loss(other, data) - rows["fp32 +ft (control)"])
    times = {}
    for mode in ("int8", "w4a8"):
        ptq = copy.deepcopy(base)
        apply_qat(ptq.model, mode, act_range=args.act_range)
        calibrate(ptq.model, calib)
        rows[f"{mode} PTQ"] = val_loss(ptq, data)
        qat = copy.deepcopy(ptq)
        times[mode] = train(qat, data, args.qat_steps, args.qat_lr, args.seed + 1)
        rows[f"{mode} QAT"] = val_loss(qat, data)
        convert(ptq.model)
        rows[f"{mode} PTQ int8"] = val_loss(ptq, data)
        convert(qat.model)
        rows[f"{mode} QAT int8"] = val_loss(qat, data)
    report(args, data, rows, noise, t_fp32, times)


def report(args, data, rows: dict, noise: float, t_fp32: float, times: dict) -> None:
    fp, ctrl = rows["fp32"], rows["fp32 +ft (control)"]
    print(f"\nLitGPT n_layer={args.n_layer} n_embd={args.n_embd}; fp32: {args.steps} steps, lr {args.lr} cosine "
          f"({t_fp32:.0f} s); QAT and fp32 control: {args.qat_steps} steps, lr {args.qat_lr} cosine; act range "
          f"{args.act_range!r}; PTQ calibrated on {args.calib_batches} batches; val: "
          f"{len(data.val_dataloader())} batches x 16 x 64 bytes")
    print(f"{'model':<22}{'val loss':>10}{'vs fp32':>10}")
    for name, v in rows.items():
        print(f"{name:<22}{v:>10.4f}{v - fp:>+10.4f}")
    print(f"\nnoise floor (same fp32 fine-tune, another batch order): {noise:.4f}")
    for mode in ("int8", "w4a8"):
        ptq, qat = rows[f"{mode} PTQ"], rows[f"{mode} QAT"]
        gap = ptq - fp
        vs_start = (ptq - qat) / gap if gap > 0 else float("nan")
        vs_ctrl = 1 - (qat - ctrl) / gap if gap > 0 else float("nan")
        note = "" if gap > 2 * noise else "  [PTQ gap below 2x the noise floor: fractions not meaningful]"
        print(f"{mode}: PTQ gap {gap:+.4f}; QAT closes {vs_start:.0%} of it vs the fp32 start, {vs_ctrl:.0%} "
              f"vs the fp32 control (QAT - control = {qat - ctrl:+.4f}); {times[mode]:.0f} s of QAT{note}")


if __name__ == "__main__":
    main()
