"""The job tests/test_restart.py starts under torchrun: the tiny GPT at tp=2 x dp=2, a checkpoint at each
epoch's end, no ckpt_path. With RESTART_KILL_AT=k, global rank 1 kills itself (SIGKILL) at step k of the
first attempt. Each rank writes each attempt's per-step losses (and times) to $RESTART_OUT."""

import json
import os
import signal
import sys
import time

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_tp import MegaStrategy, consolidate
from models import TokenData, make_model, trainer_kwargs, vocab_of

OUT, KILL_AT = os.environ["RESTART_OUT"], int(os.environ.get("RESTART_KILL_AT", "0"))
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
STEPS_PER_EPOCH, EPOCHS, BATCH = 2, 4, 4


class Record(L.Callback):
    def __init__(self):
        self.losses, self.started = {}, None

    def _write(self, trainer, **extra):
        record = dict(losses=self.losses, started=self.started, **extra)
        with open(os.path.join(OUT, f"attempt{ATTEMPT}_rank{trainer.global_rank}.json"), "w") as f:
            json.dump(record, f)

    def on_train_batch_start(self, trainer, *args):
        if self.started is None:
            self.started = time.time()  # this attempt's first step: training again

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses[trainer.global_step] = float(trainer.callback_metrics["train_loss"])
        self._write(trainer)  # what an attempt that dies leaves behind
        if ATTEMPT == 0 and trainer.global_step == KILL_AT and trainer.global_rank == 1:
            self._write(trainer, killed=time.time())
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_end(self, trainer, pl_module):
        self._write(trainer)


def main():
    model = make_model("gpt")
    ckpt = ModelCheckpoint(dirpath=os.path.join(OUT, "checkpoints"), every_n_epochs=1, save_top_k=-1)
    trainer = L.Trainer(devices=4, strategy=MegaStrategy(tp=2, timeout=60), max_epochs=EPOCHS,
                        callbacks=[Record(), ckpt], **trainer_kwargs(enable_checkpointing=True))
    dp = 2
    trainer.fit(model, TokenData(STEPS_PER_EPOCH * BATCH * dp, vocab_of(model), BATCH))
    final = os.path.join(OUT, "final.ckpt")
    trainer.save_checkpoint(final)
    if trainer.global_rank == 0:
        torch.save(consolidate(final), os.path.join(OUT, "weights.pt"))


if __name__ == "__main__":
    sys.exit(main())
