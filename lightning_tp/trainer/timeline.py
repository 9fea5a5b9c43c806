"""``PipelineTimeline``: a Lightning callback writing the pipeline's measured actions of some training steps
as one Chrome/Perfetto trace (open it at ui.perfetto.dev), every rank's in one file. See docs/planner.md."""

from __future__ import annotations

import json

import lightning as L
import torch.distributed as dist

from ..pipeline.run.loop import ActionTrace


class PipelineTimeline(L.Callback):
    """Record the training steps numbered ``steps`` (Lightning's global step) under a MegaStrategy pipeline,
    and write them to ``path`` (JSON) when training ends."""

    def __init__(self, path, steps=(3,)):
        self.path, self.steps, self.trace = str(path), set(steps), None

    def on_train_start(self, trainer, pl_module) -> None:
        runner = getattr(trainer.strategy, "runner", None)
        if runner is None:
            raise ValueError("PipelineTimeline records a pipeline's actions: use MegaStrategy(pp > 1 or microbatches "
                             "> 1).")
        mesh = trainer.strategy.mesh
        self.trace = runner.trace = ActionTrace(mesh.pp_rank, mesh.pp, trainer.global_rank, trainer.strategy.root_device)
        self.names = dict(pp=mesh.pp_rank, tp=mesh.tp_rank, dp=mesh.dp_rank)

    def on_train_batch_start(self, trainer, *args) -> None:
        self.trace.on = trainer.global_step in self.steps

    def on_train_batch_end(self, trainer, *args) -> None:
        self.trace.on = False

    def on_train_end(self, trainer, pl_module) -> None:
        mine = dict(events=self.trace.events, names=self.names, rank=trainer.global_rank)
        parts = [None] * trainer.world_size
        if dist.is_initialized() and trainer.world_size > 1:
            dist.all_gather_object(parts, mine)
        else:
            parts = [mine]
        if trainer.global_rank == 0:
            write_trace(self.path, parts)


def write_trace(path, parts: list) -> None:
    """One trace file of every rank's ``events``: a process per rank named by its place in the layout."""
    events = []
    for part in parts:
        n = part["names"]
        events.append(dict(name="process_name", ph="M", pid=part["rank"],
                           args=dict(name=f"rank {part['rank']}: stage {n['pp']} (tp {n['tp']}, dp {n['dp']})")))
        events.append(dict(name="process_sort_index", ph="M", pid=part["rank"], args=dict(sort_index=part["rank"])))
        events += [dict(name="thread_name", ph="M", pid=part["rank"], tid=t, args=dict(name=label))
                   for t, label in ((0, "compute"), (1, "waiting for input"))]
        events += part["events"]
    with open(path, "w") as f:
        json.dump(dict(traceEvents=events, displayTimeUnit="ms"), f)
