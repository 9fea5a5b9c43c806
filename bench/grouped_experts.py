"""A rank's ModuleList experts as grouped GEMMs (``torch._grouped_mm``) against the loop over them, side by
side in one run: forward and backward of the example GPT's expert MLPs on their rows, median ms of
alternating rounds and the ratio grouped / loop (< 1: grouped faster). On CUDA in bf16 where there is one.
Usage: python bench/grouped_experts.py [--reps 20 --rounds 3] [--smoke]
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from examples.gpt.model import MLP, GPTConfig  # noqa: E402
from lightning_tp.experts.blocks.grouped import grouped_forward  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEV == "cuda" else torch.float32
# (width, experts, rows over them, biases)
CASES = [(128, 4, 2048, False), (128, 8, 2048, False), (128, 4, 512, False), (128, 8, 2048, True)]


def _ms(step, reps: int) -> float:
    step()
    if DEV == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        step()
    if DEV == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps * 1e3


def measure(width: int, count: int, rows: int, bias: bool, reps: int, rounds: int) -> tuple:
    torch.manual_seed(0)
    experts = [MLP(GPTConfig(n_embd=width, bias=bias, dropout=0.0)).to(DEV, DTYPE) for _ in range(count)]
    counts = [rows // count] * count
    x = torch.randn(rows, width, device=DEV, dtype=DTYPE, requires_grad=True)
    grad = torch.randn(rows, width, device=DEV, dtype=DTYPE)

    def loop():
        torch.cat([e(c) for e, c in zip(experts, x.split(counts))]).backward(grad)

    def grouped():
        grouped_forward(experts, x, counts).backward(grad)

    assert grouped_forward(experts, x, counts) is not None, "these experts did not group"
    times = {"loop": [], "grouped": []}
    for _ in range(rounds):
        for name, step in (("loop", loop), ("grouped", grouped)):
            times[name].append(_ms(step, reps))
    loop_ms, grouped_ms = statistics.median(times["loop"]), statistics.median(times["grouped"])
    return loop_ms, grouped_ms


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one round: the path, no figures")
    args = ap.parse_args()
    cases = [(16, 4, 64, True)] if args.smoke else CASES
    reps, rounds = (2, 1) if args.smoke else (args.reps, args.rounds)
    torch.set_num_threads(1) if DEV == "cpu" else None
    print(f"| width | experts | rows | biases | loop ms | grouped ms | grouped / loop |   ({DEV}, {str(DTYPE)[6:]})")
    print("|---|---|---|---|---|---|---|")
    for width, count, rows, bias in cases:
        loop_ms, grouped_ms = measure(width, count, rows, bias, reps, rounds)
        print(f"| {width} | {count} | {rows} | {bias} | {loop_ms:.2f} | {grouped_ms:.2f} | {grouped_ms / loop_ms:.3f} |")


if __name__ == "__main__":
    main()
