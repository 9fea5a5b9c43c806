"""A Hugging Face Llama (grouped-query attention: 4 heads, 2 key/value heads) trained with tensor and
sequence parallelism on 2 CPU processes, on the byte-level Tiny Shakespeare of examples/gpt.

    python examples/hf_llama/train.py

The LightningModule is what a single-device project would write; the only parallel line is the
Trainer's ``strategy=MegaStrategy(tp=2, sp=True)``. The plan comes from the model's own
``config.base_model_tp_plan`` (found by plan="auto"). The model is built from a config: no download.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # so `examples.gpt` imports from a checkout

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from examples.gpt.lit import PrintLoss, ShakespeareData  # noqa: E402
from lightning_tp import MegaStrategy  # noqa: E402


class LlamaLM(L.LightningModule):
    def __init__(self, lr: float = 3e-3):
        super().__init__()
        self.lr = lr
        config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        self.model = LlamaForCausalLM(config)

    def training_step(self, batch, batch_idx):
        x, y = batch  # y is x shifted by one byte
        logits = self.model(input_ids=x, use_cache=False).logits
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


if __name__ == "__main__":
    L.seed_everything(0)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=MegaStrategy(tp=2, sp=True), max_steps=40,
                        callbacks=[PrintLoss()], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(LlamaLM(), ShakespeareData(block_size=64, batch_size=16))
    if trainer.is_global_zero:
        print(f"final train_loss {float(trainer.callback_metrics['train_loss']):.3f}")
