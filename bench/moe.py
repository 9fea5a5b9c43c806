"""Expert parallelism against replicated experts (2 CPU processes, gloo), side by side in one run.

Rows: the example GPT's MoE (also with round-robin routing), Hugging Face Mixtral and DeepSeek-V3
(transformers 5.x: experts as one module of 3-D weights) at ep=2 against dp=2 with every expert on both
ranks, and Mixtral at tp=2 x ep=2 (the ep
group is the tp pair: experts beyond dp) and at tp=2 x etp=2 (each expert split over the pair) against tp=2
alone (the GPT too), in alternating rounds. Printed per row: median step time as a ratio to its baseline;
for the GPT, expert parameters and optimizer state per rank, the dispatch all-to-all bytes per step against
explain's formula, the tokens each expert got in the last step, and (both GPT rows) the expert rows the
busier ep rank ran against the balanced share, every layer of every timed step.
Usage: python bench/moe.py [--steps 20 --rounds 3 --rows gpt,gpt_balanced,mixtral,deepseek_v3,mixtral_tp2,...]
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
# Hugging Face configs of the same size: 4 layers, width 128, 8 experts, top-2, byte-level vocabulary
HF_COMMON = dict(vocab_size=256, hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                 max_position_embeddings=128, attention_dropout=0.0, tie_word_embeddings=False)
HF = {"mixtral": ("MixtralConfig", dict(intermediate_size=512, num_local_experts=8, num_experts_per_tok=2,
                                        router_jitter_noise=0.0)),
      "deepseek_v3": ("DeepseekV3Config", dict(intermediate_size=512, moe_intermediate_size=512, n_routed_experts=8,
                                               num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1,
                                               n_shared_experts=1, q_lora_rank=64, kv_lora_rank=64, qk_rope_head_dim=16,
                                               qk_nope_head_dim=16, v_head_dim=32, rope_scaling=None))}
# row: (model, baseline layout, expert-parallel layout)
ROWS = {"gpt": ("gpt", {}, dict(ep=2)), "mixtral": ("mixtral", {}, dict(ep=2)),
        # the GPT with its router's logits pushed to round-robin routing (each expert the same rows): the
        # exchange's own cost, apart from the untrained router's skew
        "gpt_balanced": ("gpt_balanced", {}, dict(ep=2)),
        "deepseek_v3": ("deepseek_v3", {}, dict(ep=2)), "mixtral_tp2": ("mixtral", dict(tp=2), dict(tp=2, ep=2)),
        # each expert split over the tp pair (etp) against every tp rank running whole experts on the same tokens
        "gpt_tp2_etp2": ("gpt", dict(tp=2), dict(tp=2, etp=2)), "mixtral_tp2_etp2": ("mixtral", dict(tp=2), dict(tp=2, etp=2))}


class HFCausalLM(L.LightningModule):
    """A Hugging Face causal LM from a config (no download), as a user would wrap it."""

    def __init__(self, family: str, small: bool = False):
        super().__init__()
        import transformers

        name, kw = HF[family]
        kw = dict(HF_COMMON, **kw)
        if small:
            kw.update(hidden_size=32, intermediate_size=64, num_hidden_layers=2)
            kw.update({k: 32 for k in ("moe_intermediate_size", "q_lora_rank", "kv_lora_rank") if k in kw})
            kw.update({k: 8 for k in ("qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim") if k in kw})
        self.model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, name)(**kw))

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.model(input_ids=x).logits
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


class TokensPerExpert(L.Callback):
    """Tokens routed to each expert of every MoE layer, one list of layers per training step (this rank's batch)."""

    def __init__(self):
        self.steps, self._hooked = [], False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.steps.append([])
        if self._hooked:
            return
        self._hooked = True
        for block in pl_module.model.transformer.h:
            moe = block.mlp
            top_k, experts = moe.top_k, moe.num_experts

            def hook(module, args, out, top_k=top_k, experts=experts):
                chosen = torch.topk(torch.softmax(out.detach(), -1), top_k, dim=-1).indices
                self.steps[-1].append(torch.bincount(chosen.flatten(), minlength=experts).tolist())

            moe.gate.register_forward_hook(hook)


def _round_robin(module, args, logits):
    """Token r's logits pushed up at experts r % E and (r + 3) % E: every expert takes the same rows."""
    n, e = logits.shape
    rows, push = torch.arange(n), torch.zeros_like(logits)
    push[rows, rows % e] = push[rows, (rows + 3) % e] = 10.0
    return logits + push


def _model(name: str, model_args: dict, small: bool):
    if name.startswith("gpt"):
        model = LitGPT(**model_args)
        for block in model.model.transformer.h if name == "gpt_balanced" else ():
            block.mlp.gate.register_forward_hook(_round_robin)
        return model
    return HFCausalLM(name, small)


def _fit(name: str, layout: dict, steps: int, world: int, model_args: dict, small: bool):
    L.seed_everything(0, verbose=False)
    timer, tokens = step_times(), TokensPerExpert()
    strategy = MegaStrategy(**layout, timeout=300)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=steps,
                        callbacks=[timer] + ([tokens] if name.startswith("gpt") else []), logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0)
    model = _model(name, model_args, small)
    with comm.count_collectives() as records:
        trainer.fit(model, ShakespeareData(block_size=model_args["block_size"], batch_size=BATCH))
    a2a = sum(n * (8 if op == "all_to_all_counts" else 4) for op, n, g in records if op.startswith("all_to_all"))
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    state = sum(t.numel() * t.element_size() for s in trainer.optimizers[0].state.values()
                for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
    return dict(times=timer.times[WARMUP:], a2a=a2a / steps, experts=experts, state=state, tokens=tokens.steps[WARMUP:])


def _worker(rank, world, rows, steps, rounds, model_args, small):
    import lightning.pytorch.utilities.rank_zero as rz
    import logging

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    rz.rank_zero_info = lambda *a, **k: None
    results = {(row, side): [] for row in rows for side in (0, 1)}
    for _ in range(rounds):
        for row in rows:
            name, base, ep = ROWS[row]
            for side, layout in enumerate((base, ep)):
                results[(row, side)].append(_fit(name, layout, steps, world, model_args, small))
    return results


def _label(layout: dict) -> str:
    return " x ".join(f"{k}={v}" for k, v in layout.items()) or "dp=2"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", default=",".join(ROWS), help=f"a comma-separated choice of {list(ROWS)}")
    parser.add_argument("--smoke", action="store_true", help="a tiny model, one round, a few steps: the path, no figures")
    args = parser.parse_args()
    model_args, rows = dict(MODEL), args.rows.split(",")
    if args.smoke:
        args.steps, args.rounds = WARMUP + 2, 1
        model_args.update(n_layer=1, n_embd=32, block_size=16)
    world = 2
    ranks = run_local(world, _worker, rows, args.steps, args.rounds, model_args, args.smoke, timeout=3600)
    import transformers

    print(f"{world} processes, batch {BATCH} x {model_args['block_size']} tokens per replica, transformers "
          f"{transformers.__version__}; median step time (all ranks, all rounds), expert-parallel / baseline")
    print(f"{'model':<12} {'baseline':<10} {'expert-parallel':<16} {'base ms':>8} {'ep ms':>8} {'ratio':>6}   per round")
    for row in rows:
        name, base, ep = ROWS[row]
        median = [statistics.median(t for r in ranks for run in r[(row, side)] for t in run["times"]) for side in (0, 1)]
        per_round = [statistics.median(ranks[0][(row, 1)][i]["times"]) / statistics.median(ranks[0][(row, 0)][i]["times"])
                     for i in range(args.rounds)]
        print(f"{name:<12} {_label(base):<10} {_label(ep):<16} {median[0] * 1e3:>8.1f} {median[1] * 1e3:>8.1f} "
              f"{median[1] / median[0]:>6.3f}   " + ", ".join(f"{x:.3f}" for x in per_round))
    if "gpt" in rows:
        _gpt_details(ranks, model_args, world)
    for row in ("gpt", "gpt_balanced"):
        if row in rows:
            _skew(row, [rank[(row, 1)][-1]["tokens"] for rank in ranks])


def _gpt_details(ranks, model_args, world):
    est = explain(LitGPT(**model_args), dp=world, ep=2, batch_shape=(BATCH, model_args["block_size"]), print_report=False)
    counted = sum(r[("gpt", 1)][-1]["a2a"] for r in ranks)
    print(f"example GPT MoE: {model_args}")
    for side, ep in ((0, 1), (1, 2)):
        run = ranks[0][("gpt", side)][-1]
        print(f"ep={ep}: expert parameters per rank {run['experts']:,}, optimizer state per rank "
              f"{run['state'] / 2**20:.2f} MiB")
    print(f"all-to-all bytes per step, both ranks: counted {counted:,.0f}, explain {2 * est.rank(0).ep_bytes:,} "
          f"(ratio {counted / (2 * est.rank(0).ep_bytes):.4f})")
    for r, rank in enumerate(ranks):
        print(f"tokens per expert, layer 0, last step, rank {r}: {rank[('gpt', 1)][-1]['tokens'][-1][0]}")


def _skew(row: str, per_rank: list):
    """Rows each ep rank's experts ran (ep=2: experts in halves), every layer of every timed step of the last
    round: the step waits at each layer for the busier rank, so the sum of per-layer maxima against the
    balanced share is the expert work the routing puts on a step's critical path."""
    held = []  # [step][layer] -> rows per ep rank, both source ranks summed
    for steps in zip(*per_rank):
        held.append([])
        for layers in zip(*steps):
            counts = [sum(c) for c in zip(*layers)]
            half = len(counts) // 2
            held[-1].append([sum(counts[:half]), sum(counts[half:])])
    busiest = sum(max(h) for step in held for h in step)
    balanced = sum(sum(h) / 2 for step in held for h in step)
    layers = [sum(max(step[i]) for step in held) / sum(sum(step[i]) / 2 for step in held) for i in range(len(held[0]))]
    print(f"{row}: rows each ep rank's experts ran, layer 0, last step: {held[-1][0]}; busier rank / balanced share, "
          f"summed over layers and timed steps: {busiest / balanced:.3f} (per layer: "
          + ", ".join(f"{x:.3f}" for x in layers) + ")")


if __name__ == "__main__":
    main()
