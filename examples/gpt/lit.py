"""The LightningModule and DataModule of the example: ordinary single-device Lightning code."""

from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from .model import GPT, GPTConfig

CORPUS = Path(__file__).parent / "data" / "shakespeare.txt"


class LitGPT(L.LightningModule):
    def __init__(self, vocab_size: int = 256, block_size: int = 64, n_layer: int = 2, n_head: int = 4,
                 n_embd: int = 64, dropout: float = 0.0, tie_weights: bool = False, lr: float = 3e-3,
                 weight_decay: float = 0.0, n_expert: int = 0, n_expert_per_token: int = 2):
        super().__init__()
        self.save_hyperparameters()
        self.model = GPT(GPTConfig(vocab_size, block_size, n_layer, n_head, n_embd, dropout, True, tie_weights,
                                   n_expert, n_expert_per_token))

    def forward(self, idx):
        return self.model(idx)

    def training_step(self, batch, batch_idx):
        x, y = batch
        _, loss = self.model(x, y)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        _, loss = self.model(x, y)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)


class ByteWindows(Dataset):
    """Windows of a byte string every `stride` bytes: x is a window, y the same window shifted by one."""

    def __init__(self, data: torch.Tensor, block_size: int, stride: int):
        self.data, self.block_size, self.stride = data, block_size, stride

    def __len__(self):
        return (len(self.data) - self.block_size - 1) // self.stride + 1

    def __getitem__(self, i):
        chunk = self.data[i * self.stride: i * self.stride + self.block_size + 1].long()
        return chunk[:-1], chunk[1:]


class ShakespeareData(L.LightningDataModule):
    def __init__(self, block_size: int = 64, batch_size: int = 16, path: str = str(CORPUS)):
        super().__init__()
        self.block_size, self.batch_size, self.path = block_size, batch_size, path

    def setup(self, stage=None):
        data = torch.frombuffer(bytearray(Path(self.path).read_bytes()), dtype=torch.uint8)
        cut = int(len(data) * 0.9)
        self.train_set = ByteWindows(data[:cut], self.block_size, stride=max(1, self.block_size // 4))
        self.val_set = ByteWindows(data[cut:], self.block_size, stride=self.block_size)

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=self.batch_size, drop_last=True)


class PrintLoss(L.Callback):
    """Prints the training loss at step 1, every 10 steps and at the last (the examples' progress line)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step
        if trainer.is_global_zero and (step == 1 or step % 10 == 0 or step == trainer.max_steps):
            print(f"step {step:3d}  loss {outputs['loss'].item():.3f}", flush=True)
