"""Lightning's demo Transformer (torch's nn.Transformer encoder-decoder) trained with tensor and/or
pipeline parallelism on CPU processes, on the byte-level Tiny Shakespeare of examples/gpt.

    python examples/torch_transformer/train.py               # tp=2 on 2 processes
    python examples/torch_transformer/train.py --pp 2 --tp 1  # pp=2 (1F1B, 4 microbatches) on 2
    python examples/torch_transformer/train.py --pp 2         # tp=2 x pp=2 on 4
    python examples/torch_transformer/train.py --sp           # tp=2 + sequence parallel on 2

The LightningModule wraps ``lightning.pytorch.demos.Transformer`` as Lightning's own demo does; the
only parallel line is the Trainer's ``strategy=MegaStrategy(tp=2)``. plan="auto" finds the built-in
nn.Transformer plan: every self- and cross-attention becomes head-parallel, linear1 column- and
linear2 row-parallel. The embedding and the output layer sit outside nn.Transformer and stay
replicated. With --sp each stack's sequence is split across the tp ranks where its layers begin
and gathered after its final norm. Under pp the encoder's and the decoder's
blocks form one chain of stages: a decoder stage receives the encoder's output with its hidden
states, and the decoder's first stage holds a copy of the embedding for the decoder's own input
(its gradients summed with the first stage's, as Megatron's T5 does).

Like Lightning's demo, the decoder is fed the target sequence (under a causal mask) and the encoder
sees the whole input, so the loss falls fast: this shows the parallel training runs, not a
language model worth sampling from.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # so `examples.gpt` imports from a checkout

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from lightning.pytorch.demos import Transformer  # noqa: E402

from examples.gpt.lit import PrintLoss, ShakespeareData  # noqa: E402
from lightning_tp import MegaStrategy  # noqa: E402


class DemoTransformerLM(L.LightningModule):
    def __init__(self, lr: float = 1e-3):
        super().__init__()
        self.lr = lr
        self.model = Transformer(vocab_size=256, ninp=64, nhead=4, nhid=128, nlayers=2, dropout=0.0)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.nll_loss(self.model(x, y), y.reshape(-1))  # the model returns log-probabilities
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--microbatches", type=int, default=4, help="under pp")
    parser.add_argument("--sp", action="store_true", help="sequence parallelism (with tp > 1)")
    args = parser.parse_args()
    L.seed_everything(0)
    pipeline = dict(pp=args.pp, microbatches=args.microbatches) if args.pp > 1 else {}
    strategy = MegaStrategy(tp=args.tp, sp=args.sp, **pipeline)
    trainer = L.Trainer(accelerator="cpu", devices=args.tp * args.pp, strategy=strategy,
                        max_steps=40,
                        callbacks=[PrintLoss()], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(DemoTransformerLM(), ShakespeareData(block_size=64, batch_size=16))
    if trainer.is_global_zero:
        print(f"final train_loss {float(trainer.callback_metrics['train_loss']):.3f}")
