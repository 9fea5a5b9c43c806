"""The job tests/test_restart.py starts under torchrun: the tiny GPT at tp=2 (dp = world / 2), a checkpoint at
each epoch's end, no ckpt_path. RESTART_MODE says how the first attempt fails at step RESTART_KILL_AT: "kill"
(global rank 1 kills itself), "async" (saves are asynchronous and slowed; global rank 1 dies while the step's
save is in flight), "elastic" (a rank of the second agent kills that agent and its workers: it never comes
back), "stop" (pp=2 x dp=2: global rank 1, on the first stage, stops itself with SIGSTOP inside the pipeline
step, at its first Linear; hang_timeout=15 s stops the others). Each rank writes each attempt's per-step
losses (and times) to $RESTART_OUT."""

import json
import os
import signal
import time

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_tp import MegaStrategy, consolidate
from lightning_tp.checkpoints.files import AsyncWriter
from lightning_tp.checkpoints.newest import newest_complete
from dist import descendants
from models import TokenData, make_model, trainer_kwargs, vocab_of

OUT, KILL_AT = os.environ["RESTART_OUT"], int(os.environ.get("RESTART_KILL_AT", "0"))
MODE = os.environ.get("RESTART_MODE", "kill")
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
STEPS_PER_EPOCH, EPOCHS, BATCH = 2, 4, 4
SAMPLES = STEPS_PER_EPOCH * BATCH * 2  # an epoch at dp=2; at dp=1 a step accumulates two batches
TRAINER = []


def _killed(trainer) -> bool:
    return ATTEMPT == 0 and KILL_AT and trainer.global_step == KILL_AT


class Record(L.Callback):
    def __init__(self):
        self.losses, self.started = {}, None

    def _write(self, trainer, **extra):
        record = dict(losses=self.losses, started=self.started, world=trainer.world_size, **extra)
        path = os.path.join(OUT, f"attempt{ATTEMPT}_rank{trainer.global_rank}.json")
        with open(path + ".tmp", "w") as f:  # then renamed: a rank killed while writing (a lost agent's other
            json.dump(record, f)  # worker) leaves its last whole record, not an empty file
        os.replace(path + ".tmp", path)

    def on_train_batch_start(self, trainer, pl_module, *args):
        if self.started is None:
            self.started = time.time()  # this attempt's first step: training again
        if MODE == "stop" and ATTEMPT == 0 and trainer.global_step == KILL_AT - 1 and trainer.global_rank == 1:
            def stop(module, args):  # inside the pipeline step: the stage's forward of this microbatch
                self._write(trainer, killed=time.time())
                os.kill(os.getpid(), signal.SIGSTOP)
            for m in pl_module.modules():
                if isinstance(m, torch.nn.Linear):
                    m.register_forward_pre_hook(stop)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses[trainer.global_step] = float(trainer.callback_metrics["train_loss"])
        self._write(trainer)  # what an attempt that dies leaves behind
        if _killed(trainer) and MODE == "kill" and trainer.global_rank == 1:
            self._write(trainer, killed=time.time())
            os.kill(os.getpid(), signal.SIGKILL)
        if _killed(trainer) and MODE == "elastic" and os.environ.get("GROUP_RANK") == "1" and trainer.local_rank == 0:
            self._write(trainer, killed=time.time())
            agent = int(os.environ["LTP_TEST_AGENT_PID"])  # a node lost: its agent, then its workers
            workers = descendants(agent)
            os.kill(agent, signal.SIGKILL)
            for pid in [p for p in workers if p != os.getpid()] + [os.getpid()]:
                os.kill(pid, signal.SIGKILL)

    def on_train_end(self, trainer, pl_module):
        self._write(trainer)


def _slow_async_saves():
    """Each asynchronous write starts 3 s late; rank 1 dies just after the save at step RESTART_KILL_AT began."""
    start = AsyncWriter.start

    def slow_start(self, tensors, ready, tmp, finish):
        start(self, tensors, lambda: (time.sleep(3), ready()), tmp, finish)
        trainer = TRAINER[0]
        if _killed(trainer) and trainer.global_rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)

    AsyncWriter.start = slow_start


def main():
    model = make_model("gpt")
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "4"))
    ckpt = ModelCheckpoint(dirpath=os.path.join(OUT, "checkpoints"), every_n_epochs=1, save_top_k=-1)
    layout = dict(pp=2, microbatches=2, hang_timeout=15) if MODE == "stop" else dict(tp=2)
    trainer = L.Trainer(devices=local, num_nodes=int(os.environ.get("WORLD_SIZE", local)) // local,
                        strategy=MegaStrategy(timeout=60, async_save=MODE == "async", **layout), max_epochs=EPOCHS,
                        callbacks=[Record(), ckpt], **trainer_kwargs(enable_checkpointing=True))
    TRAINER.append(trainer)
    if MODE == "async":
        _slow_async_saves()
    trainer.fit(model, TokenData(SAMPLES, vocab_of(model), BATCH))  # its last save is in place when fit returns
    if trainer.global_rank == 0:
        final = newest_complete([ckpt.dirpath])
        assert f"step={EPOCHS * STEPS_PER_EPOCH}" in final.name, final
        torch.save(consolidate(final), os.path.join(OUT, "weights.pt"))


if __name__ == "__main__":
    main()  # no sys.exit: under torchrun --run-path the worker's function must return
