"""A Hugging Face T5 (encoder-decoder) trained with pipeline (and tensor) parallelism on CPU
processes, on the byte-level Tiny Shakespeare of examples/gpt.

    python examples/hf_t5/train.py                # pp=2 (1F1B, 4 microbatches) on 2 processes
    python examples/hf_t5/train.py --tp 2         # tp=2 x pp=2 on 4
    python examples/hf_t5/train.py --tp 2 --pp 1  # tp=2 on 2
    python examples/hf_t5/train.py --tp 2 --sp    # tp=2 + sequence parallel x pp=2 on 4

The LightningModule is what a single-device project would write; the only parallel line is the
Trainer's ``strategy=MegaStrategy(pp=2, microbatches=4)``. The model's two block lists (encoder,
then decoder) are found on their own and cut into one chain of stages: the decoder's stages receive
the encoder's output and T5's position bias with their hidden states, and the decoder's first stage
keeps a copy of the shared embedding (its gradients summed with the first stage's and the tied
head's). Under tp the plan for T5's layout is found on its own too (plans/hf_seq2seq.py): q/k/v
and the MLP split by heads and columns, the position bias by head. The model is built from a
config: no download.

Like Lightning's demo Transformer, the decoder is taught to continue the text the encoder sees in
full, so the loss falls fast: this shows the pipeline trains, not a model worth sampling from.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # so `examples.gpt` imports from a checkout

import lightning as L  # noqa: E402
import torch  # noqa: E402
from transformers import T5Config, T5ForConditionalGeneration  # noqa: E402

from examples.gpt.lit import PrintLoss, ShakespeareData  # noqa: E402
from lightning_tp import MegaStrategy  # noqa: E402


class T5LM(L.LightningModule):
    def __init__(self, lr: float = 3e-3):
        super().__init__()
        self.lr = lr
        config = T5Config(vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                          dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
        self.model = T5ForConditionalGeneration(config)

    def training_step(self, batch, batch_idx):
        x, y = batch  # y is x shifted by one byte
        loss = self.model(input_ids=x, labels=y).loss
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=4, help="under pp")
    parser.add_argument("--sp", action="store_true", help="sequence parallelism (with tp > 1)")
    args = parser.parse_args()
    L.seed_everything(0)
    pipeline = dict(pp=args.pp, microbatches=args.microbatches) if args.pp > 1 else {}
    strategy = MegaStrategy(tp=args.tp, sp=args.sp, **pipeline)
    trainer = L.Trainer(accelerator="cpu", devices=args.tp * args.pp, strategy=strategy,
                        max_steps=40, callbacks=[PrintLoss()], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(T5LM(), ShakespeareData(block_size=64, batch_size=16))
    if trainer.is_global_zero:
        print(f"final train_loss {float(trainer.callback_metrics['train_loss']):.3f}")
