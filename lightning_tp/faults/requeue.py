"""SLURM's requeue signal under MegaStrategy: Lightning saves its ``hpc_ckpt`` inside the signal handler, on
each rank wherever it was, and this strategy's save has collectives. The signal is noted instead, agreed on
by an all-reduce started at each batch and read at the next, and Lightning's handler runs on every rank then."""

from __future__ import annotations

import signal
from typing import Optional

import torch
import torch.distributed as dist

from ..comm import record


class DeferredRequeue:
    """Holds SLURM's requeue signal until every rank is at the same batch; then runs Lightning's handler there."""

    def __init__(self, trainer, device):
        self.trainer, self.device = trainer, device
        self.signum, self.handler, self.noted = None, None, False
        self.pending: Optional[tuple] = None  # (work or None without a group, flag) of the last batch's all-reduce

    def install(self) -> bool:
        """Take the requeue signal from Lightning's handler, if Lightning set one (SLURM with auto_requeue)."""
        environment = self.trainer._accelerator_connector.cluster_environment
        signum = getattr(environment, "requeue_signal", None)
        current = signal.getsignal(signum) if signum is not None else None
        handlers = getattr(current, "signal_handlers", [])
        if not any(getattr(h, "__name__", "") == "_slurm_sigusr_handler_fn" for h in handlers):
            return False
        self.signum, self.handler = signum, current
        signal.signal(signum, self._note)
        return True

    def _note(self, signum, frame) -> None:
        self.noted = True

    def at_batch(self) -> None:
        """Read the agreement started at the last batch (Lightning's handler runs if any rank was signalled), and
        start this batch's; one small all-reduce a batch, waited for a batch later."""
        if self.signum is None:
            return
        if self.pending is not None:
            work, flag = self.pending
            if work is not None:
                work.wait()
            if flag.item():
                self.pending, self.noted = None, False
                self.handler(self.signum, None)
        flag = torch.tensor([1 if self.noted else 0], device=self.device)
        record("all_reduce", flag, None)
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True) if dist.is_initialized() else None
        self.pending = (work, flag)

    def close(self) -> None:
        if self.pending is not None and self.pending[0] is not None:
            self.pending[0].wait()
        self.pending = None
