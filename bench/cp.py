"""Context parallelism: activation memory per rank and step time at cp = 1, 2 and 4, in one run.

The example GPT (4 blocks) trains under MegaStrategy(cp=N) on N local processes (1 CPU thread each) at
several sequence lengths. Printed: the bytes autograd keeps from one training step's forward on a rank
(distinct storages, parameters left out), their ratio to cp=1 at the same length, the longest length
whose bytes fit cp=1's at --budget-seq; the median step time of each cp against cp=1 at --time-seq
(cp ranks use N cores where cp=1 uses one); explain's activation estimate as a ratio to the measured bytes;
and the ring's bytes sent per rank and step, counted, against explain's figure.
"""

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning as L  # noqa: E402
import torch  # noqa: E402

from lightning_tp.testing import run_local  # noqa: E402

WARMUP = 2


def _fit(rank, world, seq, steps, width, heads, batch):
    from examples.gpt.lit import LitGPT, ShakespeareData
    from lightning_tp import MegaStrategy, comm
    from lightning_tp.layout_search.calibrate import step_times
    from lightning_tp.layout_search.measure import saved_bytes

    L.seed_everything(0, verbose=False)
    saved, times = saved_bytes(), step_times()
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=MegaStrategy(cp=world, timeout=300),
                        max_steps=steps, callbacks=[saved, times], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    with comm.count_collectives() as records:
        trainer.fit(LitGPT(n_layer=4, n_embd=width, n_head=heads, block_size=seq),
                    ShakespeareData(block_size=seq, batch_size=batch))
    ring = sum(n for op, n, _ in records if op == "ring_send") * 4 / steps  # fp32 elements -> bytes
    return dict(saved=sum(saved.per_step[-1].values()), times=times.times[WARMUP:], ring=ring)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seqs", default="256,512,1024,2048")
    parser.add_argument("--cps", default="1,2,4")
    parser.add_argument("--budget-seq", type=int, default=512, help="the memory budget: cp=1's bytes at this length")
    parser.add_argument("--time-seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=8, help=f"per fit; the first {WARMUP} are not timed")
    parser.add_argument("--smoke", action="store_true", help="a tiny model, one length, a few steps: the path, no figures")
    args = parser.parse_args()
    if args.smoke:
        args.width, args.heads, args.seqs, args.cps, args.budget_seq, args.time_seq, args.steps = \
            32, 2, "32", "1,2", 32, 32, WARMUP + 2
    seqs, cps = [int(s) for s in args.seqs.split(",")], [int(c) for c in args.cps.split(",")]
    from lightning_tp.explain.estimate import explain

    got = {(cp, seq): run_local(cp, _fit, seq, args.steps, args.width, args.heads, args.batch)[0]
           for cp in cps for seq in seqs}
    print(f"example GPT (4 blocks, width {args.width}, {args.heads} heads, batch {args.batch}, fp32), "
          f"MegaStrategy(cp=N) on N processes of 1 CPU thread:")
    print(f"{'cp':>3}{'seq':>7}{'saved for backward / rank':>28}{'vs cp=1':>9}{'explain':>10}"
          f"{'ring bytes/step':>17}{'explain':>12}")
    for cp in cps:
        for seq in seqs:
            g = got[(cp, seq)]
            from examples.gpt.model import GPT, GPTConfig

            with torch.device("meta"):
                model = GPT(GPTConfig(n_layer=4, n_embd=args.width, n_head=args.heads, block_size=seq))
            modelled = explain(model, cp=cp, batch_shape=(args.batch, seq), print_report=False).ranks[0]
            print(f"{cp:>3}{seq:>7}{g['saved'] / 2**20:>24.2f} MiB{g['saved'] / got[(cps[0], seq)]['saved']:>9.3f}"
                  f"{modelled.act_bytes / g['saved']:>9.3f}x{g['ring']:>17,.0f}{modelled.cp_bytes:>12,.0f}")
    budget = got[(cps[0], args.budget_seq)]["saved"]
    print(f"memory budget {budget / 2**20:.2f} MiB per rank (cp={cps[0]} at {args.budget_seq} tokens, +1%): longest "
          f"length that fits " + ", ".join(
              f"cp={cp}: {max([s for s in seqs if got[(cp, s)]['saved'] <= 1.01 * budget], default=0)}" for cp in cps))
    base = statistics.median(got[(cps[0], args.time_seq)]["times"])
    print(f"step time at {args.time_seq} tokens against cp={cps[0]}: " +
          ", ".join(f"cp={cp} {statistics.median(got[(cp, args.time_seq)]['times']) / base:.3f}" for cp in cps))


if __name__ == "__main__":
    main()
