"""ZeRO-1 and ZeRO-3 against zero=0: bytes per rank and step time, side by side in one run (CPU, gloo).

Two models built as real ones are: the example GPT (LitGPT) and a Hugging Face Llama built from a
config (byte-level vocabulary), both AdamW, trained on the example's Shakespeare bytes by a Lightning
Trainer with MegaStrategy(zero=0), zero=1 and zero=3 (FSDP2). One launch of dp local processes per
dp in --dp (2 and 4); in it, every round fits each model with each zero (a Trainer per fit, the order
rotated every round), so load from other processes hits them alike.

Measured on the live objects at the last warm-up step: optimizer state (every state tensor's storage),
gradients held at the optimizer step (zero=0: the parameters' .grad, all-reduced; zero=1: the slices'
.grad, reduce-scattered; the parameters' own are dropped; zero=3: the local shards of the DTensor
gradients), parameters (zero=1 keeps them whole and views them in flat buckets padded to a multiple of
dp; zero=3 holds its shards between steps, and a block's whole weights while it runs, not counted). Bytes are distinct storages on the rank, the most any
rank holds. Step time: on_train_batch_start to on_train_batch_end after warm-up, median over the steps
of every round and rank (also: the median of the rounds' ratios, the 20th percentile, and the process's
CPU time, which other load does not inflate); split by hooks into forward, backward, the gradient sync
after it (what is left of the all-reduce or reduce-scatter the backward started) and the optimizer step
(zero=1: with its all-gather). --profile adds one fit of each per round with the sync's parts timed
(see Parts); those fits are not in the ratios. dp=4 on a 2-core machine runs 4 processes on 2 cores:
its bytes hold, its times are oversubscribed (the timing claim is dp=2).

    .venv/bin/python bench/zero.py [--dp 2,4] [--models gpt,llama] [--zero 0,1,3] [--steps 10] [--rounds 5]
                                   [--profile] [--bucket-mib 4]
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

import lightning as L  # noqa: E402
import torch  # noqa: E402

from lightning_tp.testing import run_local  # noqa: E402
from examples.gpt.lit import LitGPT, ShakespeareData  # noqa: E402
from lightning_tp import MegaStrategy  # noqa: E402
from lightning_tp.dp.zero.local_shards import local  # noqa: E402

SEQ, BATCH, WARMUP = 64, 16, 3
GPT = dict(n_layer=4, n_head=4, n_embd=256, block_size=SEQ)
LLAMA = dict(vocab_size=256, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=SEQ, tie_word_embeddings=False)
PHASES = ("forward", "backward", "sync", "step")
PARTS = ("ar_start", "ar_wait", "rs_start", "copy", "rs_wait", "all_gather")


class LlamaLM(L.LightningModule):
    """A Hugging Face Llama from a config (no download), byte-level, as a user would wrap it."""

    def __init__(self, lr: float = 3e-3):
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        self.lr = lr
        self.model = LlamaForCausalLM(LlamaConfig(**LLAMA))

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


MODELS = {"gpt": lambda: LitGPT(**GPT), "llama": LlamaLM}


def _storages(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one buffer counted once)."""
    seen = {}
    for t in tensors:
        if t is not None and torch.is_tensor(t):
            s = local(t).untyped_storage()  # zero=3: the DTensor's local shard
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


class Probe(L.Callback):
    """Step time split by hooks, and bytes per rank on the live objects at the last warm-up step (so
    counting them is not in a timed step)."""

    def __init__(self, parts=None):
        self.steps, self.cpus, self.bytes, self.parts = [], [], {}, parts

    def counting(self, trainer) -> bool:
        return trainer.global_step == WARMUP - 1

    def on_train_batch_start(self, trainer, *args):
        if self.parts is not None and trainer.global_step == WARMUP:  # --profile: timed steps only
            self.parts.acc.update({k: 0.0 for k in self.parts.acc})
        self.t, self.cpu = [time.perf_counter()], time.process_time()

    def on_before_backward(self, *args):
        self.t.append(time.perf_counter())

    def on_after_backward(self, *args):
        self.t.append(time.perf_counter())

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.t.append(time.perf_counter())
        if not self.counting(trainer):
            return
        held = [p.grad for g in optimizer.param_groups for p in g["params"]]
        held += [p.grad for p in pl_module.parameters()]  # zero=1 drops them: none left
        self.bytes["grads"] = _storages(held)
        overlap = trainer.strategy._grads.overlap  # private: the buckets the backward starts
        self.bytes["buckets"] = len(getattr(overlap, "buckets", []))

    def on_train_batch_end(self, trainer, pl_module, *args):
        self.t.append(time.perf_counter())
        self.steps.append([b - a for a, b in zip(self.t, self.t[1:])])
        self.cpus.append(time.process_time() - self.cpu)
        if trainer.global_step != WARMUP:  # (counted after the optimizer step)
            return
        opt = trainer.optimizers[0]
        self.bytes["state"] = _storages(t for s in opt.state.values() for t in s.values())
        self.bytes["params"] = _storages(list(pl_module.parameters())
                                         + [p for g in opt.param_groups for p in g["params"]])


class Parts:
    """--profile: the gradient sync's and the step's parts, timed by wrapping what lightning_tp calls
    (nothing in it is changed; a part whose function is not there stays 0). zero=0: ``ar_start`` (a
    bucket's flatten and launch, in the backward), ``ar_wait`` (waiting for the all-reduces after it, and
    the copy back). zero=1: ``rs_start`` (a bucket's copy into the flat buffer and launch; in the
    backward where it is overlapped), ``copy`` (that copy alone, the has-a-gradient flags
    included), ``rs_wait`` (waiting for the reduce-scatters), ``all_gather``."""

    def __init__(self):
        from lightning_tp import comm
        from lightning_tp.dp import overlap as dp_overlap
        from lightning_tp.dp.zero import optimizer as zopt
        from lightning_tp.dp.zero import shards

        self.acc = {k: 0.0 for k in PARTS}
        self.patches, acc, inside = [], self.acc, {"copy": None}

        def wrap(owner, name, key=None, before=None, after=None):
            original = getattr(owner, name, None)
            if original is None:
                return

            def wrapper(*a, **k):
                t = time.perf_counter()
                if before:
                    before(t)
                try:
                    return original(*a, **k)
                finally:
                    if after:
                        after()
                    if key:
                        acc[key] += time.perf_counter() - t
            self.patches.append((owner, name, original))
            setattr(owner, name, wrapper)

        # copy: start_reduce_scatter's body up to the collective (it records it just before launching)

        def started(t):
            inside["copy"] = t

        def done():
            inside["copy"] = None
        wrap(shards.Bucket, "start_reduce_scatter", "rs_start", before=started, after=done)
        record = comm.record

        def record_(op, t, group):
            if inside["copy"] is not None and op == "reduce_scatter":
                acc["copy"] += time.perf_counter() - inside["copy"]
            return record(op, t, group)
        self.patches.append((comm, "record", record))
        comm.record = record_
        wrap(shards.Bucket, "finish_reduce_scatter", "rs_wait")
        wrap(zopt.ShardedOptimizer, "all_gather", "all_gather")
        wrap(dp_overlap.DPOverlap, "_launch", "ar_start")
        wrap(dp_overlap, "settle", "ar_wait")

    def remove(self):
        for owner, name, original in reversed(self.patches):
            setattr(owner, name, original)


def _fit(kind: str, zero: int, steps: int, world: int, profile: bool = False) -> dict:
    L.seed_everything(0, verbose=False)
    parts = Parts() if profile else None
    probe = Probe(parts)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=MegaStrategy(zero=zero, timeout=300),
                        max_steps=steps, callbacks=[probe], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    model = MODELS[kind]()
    try:
        trainer.fit(model, ShakespeareData(block_size=SEQ, batch_size=BATCH))
    finally:
        if parts is not None:
            parts.remove()
    out = dict(steps=probe.steps[WARMUP:], cpus=probe.cpus[WARMUP:], **probe.bytes,
               numel=sum(p.numel() for p in model.parameters()))
    if parts is not None:
        out["parts"] = {k: v / (steps - WARMUP) for k, v in parts.acc.items()}  # per timed step
    return out


def smaller_buckets(mib: float) -> None:
    """--bucket-mib: zero=0's and zero=1's gradient buckets cut at ``mib`` MiB instead of the library's
    default (patched in this process only), so that more than one starts during the backward."""
    import functools

    from lightning_tp.dp import overlap as dp_overlap, grads
    from lightning_tp.dp.zero import optimizer as zopt

    limit = int(mib * 2**20)
    zopt.chunked = functools.partial(grads.chunked, limit=limit)
    init = dp_overlap.DPOverlap.__init__
    dp_overlap.DPOverlap.__init__ = functools.partialmethod(init, bucket_bytes=limit)


def work(rank, world, models, steps, rounds, profile, bucket_mib=None, zeros=(0, 1)):
    import logging

    import lightning.pytorch.utilities.rank_zero as rz

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    rz.rank_zero_info = lambda *a, **k: None
    import warnings

    warnings.filterwarnings("ignore")
    if bucket_mib:
        smaller_buckets(bucket_mib)
    out = {(kind, zero): [] for kind in models for zero in zeros}
    prof = {}
    started = time.perf_counter()
    for r in range(rounds):
        for kind in models:
            for zero in zeros[r % len(zeros):] + zeros[:r % len(zeros)]:  # each first in turn
                out[kind, zero].append(_fit(kind, zero, steps, world))
            if profile:
                for zero in zeros:
                    prof.setdefault((kind, zero), []).append(_fit(kind, zero, steps, world, profile=True))
    return dict(runs=out, profile=prof, wall=time.perf_counter() - started, load=os.getloadavg())


def _median(xs):
    return statistics.median(xs) if xs else float("nan")


def _quantile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def report(dp: int, ranks: list, models, rounds: int, load_before, zeros) -> list:
    """Print one dp's figures; returns the table rows (each against zero=0)."""
    rows = []
    print(f"\n== dp={dp} ({dp} processes, 1 thread each; load average before {load_before[0]:.2f}, after "
          f"{ranks[0]['load'][0]:.2f}; {ranks[0]['wall']:.0f} s)" + ("  OVERSUBSCRIBED: "
          f"{dp} processes on {os.cpu_count()} cores, times indicative only" if dp > (os.cpu_count() or 1) else ""))
    others = [z for z in zeros if z]
    for kind in models:
        runs = {z: [run for rank in ranks for run in rank["runs"][kind, z]] for z in zeros}
        total = {z: _median([sum(s) for run in runs[z] for s in run["steps"]]) for z in zeros}
        phase = {z: [_median([s[i] for run in runs[z] for s in run["steps"]]) for i in range(len(PHASES))]
                 for z in zeros}
        step = lambda z, i: _median([sum(s) for rank in ranks for s in rank["runs"][kind, z][i]["steps"]])  # noqa: E731
        per_round = {z: [step(z, i) / step(0, i) for i in range(rounds)] for z in others}
        last = {z: {k: max(rank["runs"][kind, z][-1].get(k, 0) for rank in ranks)
                    for k in ("state", "grads", "params", "numel", "buckets")}
                for z in zeros}  # the most any rank holds
        numel = last[0]["numel"]
        print(f"{kind}: {numel:,} parameters (fp32), AdamW, batch {BATCH} x {SEQ} per rank; gradient buckets "
              + ", ".join(f"zero={z} {last[z]['buckets']}" for z in zeros if z != 3))
        print(f"  {'':24}" + "".join(f"{f'zero={z}':>14}" for z in zeros) + "".join(f"{f'zero{z}/zero0':>13}" for z in others))
        for key, name in (("state", "optimizer state"), ("grads", "grads at step"), ("params", "parameters")):
            print(f"  {name + ' (MiB/rank)':24}" + "".join(f"{last[z][key] / 2**20:14.2f}" for z in zeros)
                  + "".join(f"{last[z][key] / last[0][key]:13.3f}" for z in others))
            rows += [(dp, kind, name, z, last[0][key], last[z][key]) for z in others]
        cpu = {z: _median([c for run in runs[z] for c in run["cpus"]]) for z in zeros}
        print(f"  {'step time (ms, median)':24}" + "".join(f"{total[z] * 1e3:14.1f}" for z in zeros)
              + "".join(f"{total[z] / total[0]:13.3f}" for z in others) + "   per round: "
              + "; ".join(f"zero={z} " + ", ".join(f"{x:.3f}" for x in per_round[z]) for z in others))
        for i, name in enumerate(PHASES):
            print(f"    {name:22}" + "".join(f"{phase[z][i] * 1e3:14.1f}" for z in zeros))
        print(f"  {'CPU time (ms/step)':24}" + "".join(f"{cpu[z] * 1e3:14.1f}" for z in zeros)
              + "".join(f"{cpu[z] / cpu[0]:13.3f}" for z in others) + "   (the process's CPU, gloo's threads included)")
        fast = {z: _quantile([sum(s) for run in runs[z] for s in run["steps"]], 0.2) for z in zeros}
        print(f"  {'fastest fifth (ms)':24}" + "".join(f"{fast[z] * 1e3:14.1f}" for z in zeros)
              + "".join(f"{fast[z] / fast[0]:13.3f}" for z in others) + "   (20th percentile of step times)")
        rows += [(dp, kind, "step time", z, total[0], total[z], per_round[z], cpu, fast) for z in others]
        if ranks[0]["profile"]:
            for z in zeros:
                parts = {k: _median([run["parts"][k] for rank in ranks for run in rank["profile"][kind, z]])
                         for k in PARTS}
                shown = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in parts.items() if v > 0)
                print(f"    profile zero={z} (ms per step, separate fits): {shown}")
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dp", default="2,4")
    parser.add_argument("--models", default="gpt,llama")
    parser.add_argument("--zero", default="0,1,3", help="the stages to compare (0 always included)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--bucket-mib", type=float, default=None,
                        help="gradient buckets of this size for both (default: the library's, 25 MiB)")
    parser.add_argument("--smoke", action="store_true", help="a tiny model, one round, a few steps: the path, no figures")
    args = parser.parse_args()
    if args.smoke:  # dp=2, the GPT only, one round of WARMUP + 2 steps
        args.dp, args.models, args.steps, args.rounds = "2", "gpt", WARMUP + 2, 1
    models = args.models.split(",")
    zeros = tuple(sorted({0} | set(map(int, args.zero.split(",")))))
    torch.set_num_threads(1)
    started, rows = time.perf_counter(), []
    for dp in map(int, args.dp.split(",")):
        load = os.getloadavg()
        ranks = run_local(dp, work, models, args.steps, args.rounds, args.profile, args.bucket_mib, zeros, timeout=1800)
        rows += report(dp, ranks, models, args.rounds, load, zeros)
    print("\nagainst zero=0:")
    for row in rows:
        if row[2] == "step time":
            dp, kind, _, z, a, b, per_round, cpu, fast = row
            note = "   (oversubscribed)" if dp > (os.cpu_count() or 1) else ("   (target <= 1.05)" if z == 1 else "")
            print(f"  dp={dp} {kind:6} zero={z} step time {b / a:.3f} (median of rounds {_median(per_round):.3f}, "
                  f"fastest fifth {fast[z] / fast[0]:.3f}), CPU time {cpu[z] / cpu[0]:.3f}{note}")
    for row in rows:
        if row[2] != "step time":
            dp, kind, name, z, a, b = row
            print(f"  dp={dp} {kind:6} zero={z} {name:16} {b / a:.3f}  ({a / 2**20:.2f} -> {b / 2**20:.2f} MiB per rank)")
    cut = f"{args.bucket_mib:g} MiB" if args.bucket_mib else "as the library cuts them (25 MiB)"
    print(f"\ntotal {time.perf_counter() - started:.0f} s; buckets {cut}; steps {args.steps} per fit "
          f"({WARMUP} warm-up), "
          f"{args.rounds} rounds, the order of {zeros} rotated each round")


if __name__ == "__main__":
    main()
