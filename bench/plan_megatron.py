"""The planner's time model against published large runs: Megatron-LM's 2021 paper (Narayanan et al., "Efficient
Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", Table 1: GPT 1.7B-1T on up to 3072
A100s). For each row: the example GPT at that size on the meta device, the planner's estimate at the published
tp, pp, GPU count and batch (full recomputation, as the paper's FLOP count assumes; the microbatch size and
schedule the planner's fastest), as per-GPU TFLOP/s by the paper's formula, against the published figure; and
the planner's own best layout for the same cluster and batch.

    .venv/bin/python bench/plan_megatron.py [--hf-gpt2]   (--hf-gpt2: Hugging Face's GPT-2 built at each size)
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from examples.gpt.model import GPT, GPTConfig  # noqa: E402
from lightning_tp.layout_search import Cluster, plan  # noqa: E402

SEQ, VOCAB = 2048, 51200
# A100 80GB (Selene): 312 TFLOP/s fp16, NVLink 300 GB/s a direction, 8 x 200 Gbit/s HDR InfiniBand a node
A100 = dict(gpus_per_node=8, gpu_memory_gib=80, peak_tflops=312, intra_node_gbps=2400, inter_node_gbps=200,
            hbm_gbps=2039 * 8)
# billions, heads, hidden, layers, tp, pp, GPUs, batch, published TFLOP/s per GPU
TABLE_1 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]


def megatron_flops(batch: int, layers: int, hidden: int) -> float:
    """The paper's FLOPs per iteration (with recomputation): 96 B s l h^2 (1 + s / 6h + V / 16lh)."""
    return 96 * batch * SEQ * layers * hidden ** 2 * (1 + SEQ / (6 * hidden) + VOCAB / (16 * layers * hidden))


def build(heads: int, hidden: int, layers: int, hf_gpt2: bool = False):
    """The example GPT (or Hugging Face's GPT2LMHeadModel) of that size on the meta device."""
    with torch.device("meta"):
        if hf_gpt2:
            from transformers import GPT2Config, GPT2LMHeadModel

            return GPT2LMHeadModel(GPT2Config(n_layer=layers, n_head=heads, n_embd=hidden, n_positions=SEQ,
                                              vocab_size=VOCAB))
        return GPT(GPTConfig(n_layer=layers, n_head=heads, n_embd=hidden, block_size=SEQ, vocab_size=VOCAB,
                             dropout=0.1))


def predict(row, hf_gpt2: bool = False) -> tuple:
    """(predicted TFLOP/s per GPU at the published layout, that candidate, the planner's best, its TFLOP/s)."""
    billions, heads, hidden, layers, tp, pp, gpus, batch, published = row
    model = build(heads, hidden, layers, hf_gpt2)
    p = plan(model, gpus=gpus, global_batch=batch, seq_len=SEQ, flash=False, zeros=(0,), precision="megatron",
             cluster=Cluster(gpus=gpus, **A100))
    at = [c for c in p.fits + p.overflows if (c.tp, c.pp, c.sp, c.activation_checkpointing) == (tp, pp, False, True)]
    fits = [c for c in at if not c.overflow]
    c = min(fits or at, key=lambda c: c.step_s)
    flops = megatron_flops(batch, layers, hidden)
    return flops / (c.step_s * gpus) / 1e12, c, p[0], flops / (p[0].step_s * gpus) / 1e12


def main(hf_gpt2: bool = "--hf-gpt2" in sys.argv):
    print("Hugging Face GPT-2" if hf_gpt2 else "the example GPT")
    print(f"{'model':>8} {'tp':>3} {'pp':>3} {'GPUs':>5} {'batch':>5} | {'published':>9} {'predicted':>9} {'ratio':>6} "
          f"| layout the estimate is of | planner's best (TFLOP/s by the same formula)")
    worst = 0.0
    for row in TABLE_1[:1] if "--smoke" in sys.argv[1:] else TABLE_1:  # --smoke: the first row
        billions, heads, hidden, layers, tp, pp, gpus, batch, published = row
        started = time.perf_counter()
        tflops, c, best, best_tflops = predict(row, hf_gpt2)
        worst = max(worst, abs(tflops / published - 1))
        print(f"{billions:>7}B {tp:>3} {pp:>3} {gpus:>5} {batch:>5} | {published:>9} {tflops:>9.1f} "
              f"{tflops / published:>6.3f} | mb {c.microbatch_size} x {c.microbatches} {c.schedule} "
              f"v={c.virtual_stages}{' (does not fit)' if c.overflow else ''} | tp={best.tp}{'+sp' if best.sp else ''} "
              f"pp={best.pp} dp={best.dp} mb {best.microbatch_size} {best.schedule} v={best.virtual_stages} "
              f"recompute={best.activation_checkpointing} ({best_tflops:.0f}) [{time.perf_counter() - started:.1f} s]")
    print(f"\nlargest deviation from the published per-GPU throughput: {worst:.1%} (target: within 15%)")


if __name__ == "__main__":
    main()
