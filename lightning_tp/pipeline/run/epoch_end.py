"""torchmetrics states at an epoch's end: the last stage's, broadcast to every stage of its pipeline before the
epoch-end hooks (a callback put first). See docs/design/pipeline-run.md.
"""

from __future__ import annotations

import lightning as L
import torch.distributed as dist

from .logs import load_metric_state, metric_state_of, find_metrics


class StageMetricsSync(L.Callback):
    def __init__(self, runner):
        self.runner = runner

    def _sync(self, pl_module) -> None:
        runner = self.runner
        if runner is None or runner.layout.pp == 1:
            return
        last = runner.ranks.rank_of(runner.layout.pp - 1)
        is_last = runner.mesh.pp_rank == runner.layout.pp - 1
        paths = {id(m): p for p, m in pl_module.named_modules()}
        from torchmetrics import Metric

        metrics = [m for m in find_metrics(pl_module) if isinstance(m, Metric) and id(m) in paths]
        if not metrics:
            return
        box = [{paths[id(m)]: metric_state_of(m, paths[id(m)], {}) for m in metrics} if is_last else None]
        dist.broadcast_object_list(box, src=last, group=runner.mesh.pp_group)
        if not is_last:
            for path, state in box[0].items():
                load_metric_state(pl_module.get_submodule(path), state)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self._sync(pl_module)

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        self._sync(pl_module)

    def on_test_epoch_end(self, trainer, pl_module) -> None:
        self._sync(pl_module)


def install(trainer, runner) -> None:
    """First among the trainer's callbacks (once; pointed at this run's runner)."""
    own = next((c for c in trainer.callbacks if isinstance(c, StageMetricsSync)), None)
    if own is None:
        trainer.callbacks.insert(0, StageMetricsSync(runner))
    else:
        own.runner = runner
