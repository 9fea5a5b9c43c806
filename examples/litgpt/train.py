"""litgpt's GPT (a LLaMA-style config: grouped queries, RoPE, RMSNorm, gated MLP) trained with tensor
and sequence parallelism on 2 CPU processes, on the byte-level Tiny Shakespeare of examples/gpt.

    python examples/litgpt/train.py

The LightningModule is what a single-device project would write; the only parallel line is the
Trainer's ``strategy=MegaStrategy(tp=2, sp=True)``. plan="auto" finds the built-in litgpt plan
(fused [q|k|v] split per section, head counts divided on a per-module copy of the config). The
model is built from a Config: no download.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # so `examples.gpt` imports from a checkout

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from litgpt import GPT, Config  # noqa: E402

from examples.gpt.lit import PrintLoss, ShakespeareData  # noqa: E402
from lightning_tp import MegaStrategy  # noqa: E402


class LitGPTLM(L.LightningModule):
    def __init__(self, lr: float = 3e-3):
        super().__init__()
        self.lr = lr
        self.model = GPT(Config(block_size=64, vocab_size=256, padded_vocab_size=256, n_layer=2, n_head=4,
                                n_query_groups=2, n_embd=64, intermediate_size=128, mlp_class_name="LLaMAMLP",
                                norm_class_name="RMSNorm", rotary_percentage=1.0, parallel_residual=False,
                                bias=False))

    def training_step(self, batch, batch_idx):
        x, y = batch  # y is x shifted by one byte
        loss = F.cross_entropy(self.model(x).flatten(0, 1), y.flatten())
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


if __name__ == "__main__":
    L.seed_everything(0)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=MegaStrategy(tp=2, sp=True), max_steps=40,
                        callbacks=[PrintLoss()], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(LitGPTLM(), ShakespeareData(block_size=64, batch_size=16))
    if trainer.is_global_zero:
        print(f"final train_loss {float(trainer.callback_metrics['train_loss']):.3f}")
