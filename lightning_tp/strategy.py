"""MegaStrategy: the Lightning glue. Everything parallel lives in mesh/comm/layers/plans/grads."""

from __future__ import annotations

from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Literal, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import (_distributed_is_initialized,
                                                    _get_default_process_group_backend_for_device,
                                                    _init_dist_connection, _sync_ddp_if_available)
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only, rank_zero_warn
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

from . import checkpoint as ckpt
from . import comm
from . import grads
from .mesh import ParallelMesh, build_mesh, data_parallel_size
from .plans import apply as planner


class MegaStrategy(ParallelStrategy):
    """Tensor (tp), sequence (sp) and data parallelism for an unchanged LightningModule.

    Args:
        tp: tensor-parallel size (ranks that split each layer).
        pp: pipeline-parallel size.
        sp: sequence parallelism inside the TP region (needs tp > 1).
        plan: ``"auto"`` (find a built-in plan by module class), or a :class:`lightning_tp.Plan`/dict.
        sync_init: broadcast rank 0's initial weights before sharding, so unseeded models agree.
        start_method: ``"popen"`` (re-run the script, like DDP) or ``"spawn"``/``"fork"``.
    """

    strategy_name = "mega"

    def __init__(self, tp: int = 1, pp: int = 1, sp: bool = False, plan: Any = "auto", sync_init: bool = True,
                 process_group_backend: Optional[str] = None,
                 timeout: Optional[Union[timedelta, float]] = default_pg_timeout,
                 start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
                 accelerator=None, parallel_devices=None, cluster_environment=None, checkpoint_io=None,
                 precision_plugin=None) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        data_parallel_size(tp * pp, tp, pp)  # validates the types now, the division once the world is known
        if sp and tp == 1:
            rank_zero_warn("MegaStrategy(sp=True) needs tp > 1; sequence parallelism is off for tp=1.")
            sp = False
        self.tp, self.pp, self.sp, self.plan, self.sync_init = tp, pp, bool(sp), plan, sync_init
        self._process_group_backend = process_group_backend
        self._timeout = timedelta(seconds=timeout) if isinstance(timeout, (int, float)) else timeout
        self._start_method = start_method
        self._num_nodes = 1
        self._sync_grads = True
        self.mesh: ParallelMesh = ParallelMesh()

    # ------------------------------------------------------------------ topology

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        return True  # tells Lightning to add a DistributedSampler (with the dp rank/size below)

    @property
    def distributed_sampler_kwargs(self) -> dict:
        """Only data-parallel ranks see different data; tp/pp ranks of one replica see the same batch."""
        return {"num_replicas": self.mesh.dp, "rank": self.mesh.dp_rank}

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            if not self.cluster_environment.creates_processes_externally:
                self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes,
                                                           self.num_nodes)
        else:
            self._launcher = _MultiProcessingLauncher(self, start_method=self._start_method)

    def setup_environment(self) -> None:
        super().setup_environment()
        data_parallel_size(self.num_nodes * self.num_processes, self.tp, self.pp)  # before any collective
        if self.pp != 1:
            raise NotImplementedError("MegaStrategy(pp>1): pipeline parallelism is not available yet; use pp=1.")
        reset_seed()
        self.set_world_ranks()
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        self._process_group_backend = backend
        _init_dist_connection(self.cluster_environment, backend, timeout=self._timeout)
        self.mesh = build_mesh(self.tp, self.pp, device_type=self.root_device.type)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    # ------------------------------------------------------------------ model

    def setup(self, trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self._parallelize(self.lightning_module)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)
        self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_norm

    def _parallelize(self, module) -> None:
        done = getattr(module, "_lightning_tp", None)
        if done is not None:
            if (done["tp"], done["sp"]) != (self.tp, self.sp):
                raise ValueError(f"{type(module).__name__} was already parallelized with tp={done['tp']}, "
                                 f"sp={done['sp']}; build a fresh module for tp={self.tp}, sp={self.sp}.")
            for ctx in done["contexts"]:
                ctx.group = self.mesh.tp_group
            return
        if self.tp == 1:  # nothing to shard: the user's modules run untouched
            module._lightning_tp = {"tp": 1, "sp": False, "contexts": []}
            self._set_metric_groups(module)
            return
        matches = planner.resolve(module, self.tp, self.sp, self.plan)  # raises on every rank alike
        if self.sync_init and self.mesh.world_size > 1:
            for t in list(module.parameters()) + list(module.buffers()):
                dist.broadcast(t.data, src=0)
        replaced = planner.apply(module, matches, self.mesh.tp_group, self.tp, self.mesh.tp_rank, self.sp)
        contexts = {id(m.ctx): m.ctx for m in replaced.values() if hasattr(m, "ctx")}
        module._lightning_tp = {"tp": self.tp, "sp": self.sp, "contexts": list(contexts.values())}
        self._set_metric_groups(module)

    def _set_metric_groups(self, module) -> None:
        try:
            from torchmetrics import Metric
        except ImportError:  # pragma: no cover
            return
        for m in module.modules():
            if isinstance(m, Metric):
                m.process_group = self.mesh.dp_group  # tp replicas hold the same samples

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # ------------------------------------------------------------------ gradients

    @contextmanager
    def block_backward_sync(self):
        """Lightning enters this while accumulating gradients: skip the sync until the last micro-step."""
        self._sync_grads = False
        try:
            yield None
        finally:
            self._sync_grads = True

    def post_backward(self, closure_loss: torch.Tensor) -> None:
        super().post_backward(closure_loss)
        if self._sync_grads:
            grads.sync_gradients(self.lightning_module.parameters(), self.mesh)

    def _clip_grad_by_norm(self, optimizer, clip_val) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        grads.clip_grad_norm(params, float(clip_val), self.mesh)

    # ------------------------------------------------------------------ collectives for Lightning

    def reduce(self, tensor, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean"):
        """``self.log(..., sync_dist=True)`` lands here: reduce over data-parallel replicas only."""
        group = group if group is not None else self.mesh.dp_group
        if isinstance(tensor, torch.Tensor) and comm.group_size(group) > 1:
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        if not _distributed_is_initialized():
            return decision
        t = torch.tensor(int(decision), device=self.root_device)
        dist.all_reduce(t)
        return bool(t == self.world_size) if all else bool(t)

    def barrier(self, name: Optional[str] = None) -> None:
        if _distributed_is_initialized():
            dist.barrier()

    def broadcast(self, obj, src: int = 0):
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    # ------------------------------------------------------------------ checkpoints

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # shard first, then load this rank's shard

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options: Optional[Any] = None) -> None:
        ckpt.save(checkpoint, self.broadcast(str(filepath)), self.mesh, self.lightning_module, self.barrier,
                  self.broadcast)

    def load_checkpoint(self, checkpoint_path, weights_only: Optional[bool] = None) -> dict:
        path = self.broadcast(str(checkpoint_path))
        if ckpt.is_sharded(path):
            return ckpt.load(path, self.mesh)
        raise ValueError(f"{path} is not a lightning_tp checkpoint directory. To start a tp run from a plain "
                         f"checkpoint, load its state_dict into the module before fit.")

    def remove_checkpoint(self, filepath) -> None:
        if self.is_global_zero:
            self.checkpoint_io.remove_checkpoint(filepath)

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register("mega", cls, description="lightning-tp: tensor/sequence/data parallelism")
