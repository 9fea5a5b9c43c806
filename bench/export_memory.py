"""Peak memory of `python -m lightning_tp export` against the largest tensor and the whole model.

Writes a checkpoint of the example GPT (LitGPT, AdamW, one step) at tp=2 x pp=2 on 4 CPU processes, then,
each in a fresh process, exports it (--to plain, --to hf) and consolidates it (the whole model in one
process, for comparison). Memory is the process's peak resident set (ru_maxrss) minus that peak after the
imports and the index read; the ratio printed is that peak over the largest tensor's bytes.

    .venv/bin/python bench/export_memory.py [--vocab 32000] [--width 1024] [--layers 8] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MEASURE = r"""
import json, resource, sys, torch
import lightning_tp
from lightning_tp.checkpoints import dcp_io
from lightning_tp.checkpoints.export import export
ckpt, what, out = sys.argv[1:4]
index = dcp_io.read_index(ckpt)
rss = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
base = rss()
if what == "consolidate":
    state = lightning_tp.consolidate(ckpt)
else:
    export(ckpt, out, to=what, config=out + ".config" if what == "hf" else None)
print(json.dumps(dict(peak=rss() - base)))
"""


def _save(rank, world, path, vocab, width, layers):
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from examples.gpt.lit import LitGPT
    from lightning_tp import MegaStrategy

    L.seed_everything(0, verbose=False)
    model = LitGPT(vocab_size=vocab, block_size=32, n_layer=layers, n_head=8, n_embd=width)
    x = torch.randint(0, vocab, (4, 33))
    data = DataLoader(TensorDataset(x[:, :-1], x[:, 1:]), batch_size=4)
    trainer = L.Trainer(devices=world, accelerator="cpu", strategy=MegaStrategy(tp=2, pp=2, microbatches=2),
                        max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(model, data)
    trainer.save_checkpoint(path)
    sizes = {n: p.numel() * p.element_size() for n, p in LitGPT(vocab_size=vocab, block_size=32, n_layer=layers,
                                                                n_head=8, n_embd=width).state_dict().items()}
    return dict(largest=max(sizes.values()), total=sum(sizes.values()))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--keep", help="write the checkpoint here and keep it")
    parser.add_argument("--smoke", action="store_true", help="a tiny model, one round, a few steps: the path, no figures")
    args = parser.parse_args()
    if args.smoke:
        args.vocab, args.width, args.layers = 256, 32, 2
    from lightning_tp.testing import run_local

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.keep or tmp)
        ckpt = str(root / "gpt_tp2_pp2.ckpt")
        model = run_local(4, _save, ckpt, args.vocab, args.width, args.layers, timeout=1800)[0]
        from transformers import GPT2Config  # any config: the export copies it beside the weights

        GPT2Config().save_pretrained(str(root / "hf.config"))
        print(f"model: {model['total'] / 2**20:.0f} MiB of weights, largest tensor {model['largest'] / 2**20:.0f} MiB "
              f"(the checkpoint holds AdamW's two moments besides)")
        kinds = (("plain", root / "plain.safetensors"), ("hf", root / "hf"), ("consolidate", root / "x"))
        for what, out in kinds[:1] if args.smoke else kinds:  # --smoke: one measuring process
            got = subprocess.run([sys.executable, "-c", MEASURE, ckpt, what, str(out)], capture_output=True,
                                 text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
            if got.returncode:
                raise SystemExit(got.stderr)
            peak = json.loads(got.stdout.strip().splitlines()[-1])["peak"]
            print(f"{what:12s} peak {peak / 2**20:7.0f} MiB = {peak / model['largest']:.2f} x largest tensor, "
                  f"{peak / model['total']:.2f} x the model")


if __name__ == "__main__":
    main()
