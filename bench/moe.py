"""Expert parallelism on the example GPT's MoE (2 CPU processes, gloo), side by side in one run.

ep=2 (each rank 1/2 of the experts, all-to-all dispatch) against ep=1 (experts replicated, dp=2), in
alternating rounds. Printed: median step time as a ratio to ep=1, expert parameters and optimizer
state per rank, the dispatch all-to-all bytes per step counted against explain's formula, and the
tokens each expert got in the last step. Usage: python bench/moe.py [--steps 20 --rounds 3]
"""

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning as L  # noqa: E402
import torch  # noqa: E402

from lightning_tp.testing import run_local  # noqa: E402
from examples.gpt.lit import LitGPT, ShakespeareData  # noqa: E402
from lightning_tp import MegaStrategy, comm  # noqa: E402
from lightning_tp.explain.estimate import explain  # noqa: E402
from lightning_tp.layout_search.calibrate import step_times  # noqa: E402

MODEL = dict(n_layer=4, n_embd=128, block_size=64, n_expert=8, n_expert_per_token=2)
BATCH, WARMUP = 16, 3


class TokensPerExpert(L.Callback):
    """Tokens routed to each expert of the first MoE layer in the last training step (this rank's batch)."""

    def __init__(self):
        self.counts = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        moe = pl_module.model.transformer.h[0].mlp
        top_k, experts = moe.top_k, moe.num_experts

        def hook(module, args, out):
            chosen = torch.topk(torch.softmax(out.detach(), -1), top_k, dim=-1).indices
            self.counts = torch.bincount(chosen.flatten(), minlength=experts).tolist()

        if getattr(self, "_handle", None) is None:
            self._handle = moe.gate.register_forward_hook(hook)


def _fit(ep: int, steps: int, world: int, model_args: dict):
    L.seed_everything(0, verbose=False)
    timer, tokens = step_times(), TokensPerExpert()
    strategy = MegaStrategy(ep=ep, timeout=300)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=steps,
                        callbacks=[timer, tokens], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0)
    model = LitGPT(**model_args)
    with comm.count_collectives() as records:
        trainer.fit(model, ShakespeareData(block_size=model_args["block_size"], batch_size=BATCH))
    a2a = sum(n * (8 if op == "all_to_all_counts" else 4) for op, n, g in records if op.startswith("all_to_all"))
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    state = sum(t.numel() * t.element_size() for s in trainer.optimizers[0].state.values()
                for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
    return dict(times=timer.times[WARMUP:], a2a=a2a / steps, experts=experts, state=state, tokens=tokens.counts)


def _worker(rank, world, steps, rounds, model_args):
    import lightning.pytorch.utilities.rank_zero as rz
    import logging

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    rz.rank_zero_info = lambda *a, **k: None
    results = {1: [], 2: []}
    for _ in range(rounds):
        for ep in (1, 2):
            results[ep].append(_fit(ep, steps, world, model_args))
    return results


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="a tiny model, one round, a few steps: the path, no figures")
    args = parser.parse_args()
    model_args = dict(MODEL)
    if args.smoke:
        args.steps, args.rounds = WARMUP + 2, 1
        model_args.update(n_layer=1, n_embd=32, block_size=16)
    world = 2
    ranks = run_local(world, _worker, args.steps, args.rounds, model_args, timeout=3600)
    median = {ep: statistics.median(t for r in ranks for run in r[ep] for t in run["times"]) for ep in (1, 2)}
    per_round = [statistics.median(ranks[0][2][i]["times"]) / statistics.median(ranks[0][1][i]["times"])
                 for i in range(args.rounds)]
    est = explain(LitGPT(**model_args), dp=world, ep=2, batch_shape=(BATCH, model_args["block_size"]), print_report=False)
    counted = sum(r[2][-1]["a2a"] for r in ranks)
    print(f"example GPT MoE: {model_args}, batch {BATCH} per rank, {world} processes (dp={world})")
    print(f"step time ep=2 / ep=1 (median): {median[2] / median[1]:.3f}   per round (rank 0): "
          + ", ".join(f"{x:.3f}" for x in per_round))
    print(f"median step: ep=1 {median[1] * 1e3:.1f} ms, ep=2 {median[2] * 1e3:.1f} ms")
    for ep in (1, 2):
        run = ranks[0][ep][-1]
        print(f"ep={ep}: expert parameters per rank {run['experts']:,}, optimizer state per rank "
              f"{run['state'] / 2**20:.2f} MiB")
    print(f"all-to-all bytes per step, both ranks: counted {counted:,.0f}, explain {2 * est.rank(0).ep_bytes:,} "
          f"(ratio {counted / (2 * est.rank(0).ep_bytes):.4f})")
    for r, rank in enumerate(ranks):
        print(f"tokens per expert, layer 0, last step, rank {r}: {rank[2][-1]['tokens']}")


if __name__ == "__main__":
    main()
