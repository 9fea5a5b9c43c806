"""What a job restarted by its launcher (torchrun --max-restarts, SLURM requeue) needs: to know it was
restarted, and a process-group store of its own attempt (the agent's store still holds the dead attempt's
addresses, which a new group would read and fail to connect to). See docs/fault-tolerance.md."""

from __future__ import annotations

import os
from typing import Optional

import torch.distributed as dist

RESTARTS = ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")  # set by torchrun's agent / SLURM's requeue


def attempt() -> int:
    """How many times a launcher restarted this job (0: the run the user started)."""
    return max(int(os.environ.get(name, "0") or 0) for name in RESTARTS)


def restarted() -> bool:
    """Only a restarted job resumes by itself under ``resume="auto"``: a run the user started never does."""
    return attempt() > 0


def attempt_store(cluster_environment, rank: int, world_size: int, timeout) -> Optional[dist.Store]:
    """After a torchrun restart: the env:// store under a prefix of this attempt (None on the first run)."""
    count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if count == 0 or dist.is_initialized():
        return None
    os.environ["MASTER_ADDR"] = cluster_environment.main_address
    os.environ["MASTER_PORT"] = str(cluster_environment.main_port)
    store, _, _ = next(dist.rendezvous("env://", rank, world_size, timeout=timeout))
    return dist.PrefixStore(f"lightning_tp/attempt_{count}", store)


def keep_global_batch(trainer, saved_dp: Optional[int], dp: int) -> None:
    """A restart at another dp (an elastic job that lost or gained nodes): ``accumulate_grad_batches`` scaled so
    each optimizer step sees as many samples as before; refused where no whole number of batches does."""
    if not saved_dp or saved_dp == dp:
        return
    acc = trainer.accumulate_grad_batches
    total = saved_dp * acc
    if total % dp:
        raise ValueError(f"MegaStrategy(resume=...): the checkpoint was written at dp={saved_dp} with "
                         f"accumulate_grad_batches={acc}, a global batch of {total} per-rank batches, and this restart "
                         f"has dp={dp}, which does not divide it: no accumulation keeps the global batch. Restart on a "
                         f"world whose dp divides {total}, or resume with ckpt_path= to choose the batch yourself.")
    trainer.accumulate_grad_batches = total // dp
    from lightning.pytorch.utilities.rank_zero import rank_zero_warn

    rank_zero_warn(f"MegaStrategy: this restart has dp={dp} where the checkpoint had dp={saved_dp}; "
                   f"accumulate_grad_batches is now {total // dp} (was {acc}), so the global batch keeps its size.")
