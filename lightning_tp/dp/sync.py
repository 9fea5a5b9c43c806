"""GradSync: the one object that owns how a run's gradients cross data parallelism, zero=0 (all-reduce
overlapped with the backward), zero=1 (reduce-scatter into sharded optimizers) or zero=3 (FSDP2), from
setup to the optimizer step. See docs/design/grads-and-dp.md."""

from __future__ import annotations

from typing import Callable

from lightning.pytorch.utilities import rank_zero_warn

from ..marks import marks_of
from ..pipeline.cut.block_lists import block_at
from . import grads
from .overlap import DPOverlap
from .zero import fsdp, shard_optimizers
from .zero.overlap import ZeroOverlap


class GradSync:
    """``armed()`` says whether a backward syncs (False while Lightning accumulates). Set up in order:
    :meth:`attach` (the module and its pipeline runner), :meth:`shard_module`, :meth:`shard_optimizers`."""

    def __init__(self, config, mesh, armed: Callable[[], bool]):
        self.config, self.mesh, self.armed = config, mesh, armed
        self.overlap = None  # zero=0: a DPOverlap; zero=1: a ZeroOverlap
        self.zero = []  # zero=1: the sharded optimizers
        self.fsdp = False  # zero=3: the parameters sharded by FSDP2
        self.runner = None

    # ---------------------------------------------------------------- setup

    def attach(self, module, runner, reused: bool) -> None:
        """zero=0 at dp > 1: the all-reduce overlapped with the backward (a pipeline's: started by its last
        microbatch, and only without accumulation over batches, when its tensor is the step's gradient).
        A module parallelized before keeps this object's overlap, if any; a new strategy's syncs after."""
        self.runner = runner
        self.fsdp = fsdp.sharded_before(module)
        if reused:  # (its runner, if any, was told to leave the sync to the step's end)
            return
        self.remove()
        if self.mesh.replicas == 1 or self.config.zero:  # zero=1: its own overlap, once the optimizer is sharded
            return
        params = [p for p in module.parameters() if not marks_of(p).expert]  # experts: over expert-dp, after
        self._install(module, lambda armed, hooked: DPOverlap(params, self.mesh.dp_group, self.mesh.replicas,
                                                              armed=armed, hooked=hooked))

    def shard_module(self, module, places) -> None:
        """zero=3 at dp > 1: the parameters sharded over dp with FSDP2, each of ``places``' blocks a unit.
        Call after the module has its tp layout, dtype and device."""
        if self.fsdp or self.config.zero != 3 or self.mesh.dp == 1:
            return
        fsdp.shard_parameters(module, self.mesh.device_mesh["dp"], fsdp_blocks(module, places))
        self.fsdp = True

    def shard_optimizers(self, optimizers, module) -> None:
        """zero=1 at dp > 1: each optimizer sharded over dp, its reduce-scatter overlapped with the backward; a
        warning at dp = 1 (zero=3: FSDP2 has sharded the parameters, and so the optimizer's state, already)."""
        if not self.config.zero:
            return
        if self.mesh.replicas == 1:
            rank_zero_warn(f"MegaStrategy(zero={self.config.zero}) shards over data-parallel ranks, but dp=1 here "
                           f"(world {self.mesh.world_size} / (tp={self.mesh.tp} x pp={self.mesh.pp})): nothing is "
                           f"sharded.")
            return
        if not module.automatic_optimization:
            raise ValueError(f"MegaStrategy(zero={self.config.zero}) needs automatic optimization; with manual "
                             f"optimization use zero=0.")
        self.zero = [] if self.fsdp else shard_optimizers(optimizers, self.mesh)
        if self.zero:
            self.remove()
            self._install(module, lambda armed, hooked: ZeroOverlap(self.zero, armed, hooked=hooked))

    def _install(self, module, make) -> None:
        """``make(armed, hooked)``'s overlap: hooked on the backward, or under a pipeline started by its runner's
        last microbatch, and only without accumulation over batches (then its tensor is the step's gradient)."""
        if self.runner is None:
            self.overlap = make(self.armed, True)
            return
        trainer = module.trainer
        self.overlap = self.runner.dp_overlap = make(
            lambda: self.armed() and trainer.accumulate_grad_batches == 1, False)

    @property
    def sharded(self) -> bool:
        """Whether each dp rank steps only its part (zero=1 slices or zero=3 shards)."""
        return bool(self.zero) or self.fsdp

    # ---------------------------------------------------------------- each step

    def merge_pipeline_grads(self, module) -> None:
        """A pipeline's step made the gradients inside the step: hand them to ``.grad``."""
        from ..pipeline.run.executor import PipelineRunner

        PipelineRunner.merge_grads(module, self.overlap)

    def sync(self, params, repeated: bool) -> None:
        """After a backward that ends accumulation: every gradient summed over dp (or into its slices)."""
        grads.sync_gradients(params, self.mesh, self.overlap, repeated=repeated, zero=self.zero)

    def clip(self, optimizer, max_norm: float, device) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        grads.clip_grad_norm(params, max_norm, self.mesh, zero=_sharded_of(optimizer), device=device)

    def after_step(self, optimizer, automatic: bool) -> None:
        """zero=1: every rank's stepped slices back into the parameters; manual optimization: this optimizer's
        parameters sum whole gradients again (another optimizer may go on accumulating)."""
        sharded = _sharded_of(optimizer)
        if sharded is not None:
            sharded.all_gather()
        if not automatic:
            grads.forget_sums(p for group in optimizer.param_groups for p in group["params"])

    def remove(self) -> None:
        if self.overlap is not None:
            self.overlap.remove()
            self.overlap = None


def _sharded_of(optimizer):
    """The ShardedOptimizer of a zero=1 optimizer (Lightning may wrap it), else None."""
    return getattr(getattr(optimizer, "_optimizer", optimizer), "_lightning_tp_zero", None)


def fsdp_blocks(module, places) -> list:
    """The blocks at ``places`` ((list path, index), None: no block list) that zero=3 shards as units of their
    own; without a block list the whole model is one."""
    return [block_at(module.get_submodule(path), i) for path, i in places or ()]
