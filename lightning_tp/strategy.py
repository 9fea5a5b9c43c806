"""MegaStrategy: the Lightning glue. What it does to the model is in parallelize.py; the package map is
docs/design/README.md."""

from __future__ import annotations

import os
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Literal, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import (_distributed_is_initialized,
                                                    _get_default_process_group_backend_for_device,
                                                    _init_dist_connection, _sync_ddp_if_available,
                                                    _all_gather_ddp_if_available)
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only, rank_zero_warn
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

from .checkpoints import files as ckpt
from . import comm
from .config import ParallelConfig
from .context import runtime as context_runtime
from .dp import grads
from .trainer.averaged_models import copy_averaged_models_again
from .checkpoints.newest import newest_complete
from .faults.requeue import DeferredRequeue
from .faults.resumable_data import resumable
from .faults.restarts import attempt_store, keep_global_batch, restarted
from .faults.notes import FailureNotes, raise_on_every_rank
from .mesh import ParallelMesh, build_mesh, gloo_twin_of_replica_group
from .pipeline.run.epoch_end import install as install_epoch_end_sync
from .parallelize import parallelize
from .trainer.same_batch import BatchBroadcast
from .dp.sync import GradSync


def _step_args(args, kwargs, loop_batch_idx) -> tuple:
    """(batch, what the user's step is given besides it, batch_idx): Lightning passes ``batch_idx``
    (and ``dataloader_idx``) only where the user's step takes them; they go on to every microbatch's
    call as given. ``batch_idx`` defaults to the loop's, which the first-batch checks read."""
    kwargs = dict(kwargs)
    batch = args[0] if args else kwargs.pop("batch")
    rest = (tuple(args[1:]), kwargs)
    batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", loop_batch_idx)
    return batch, rest, batch_idx


class MegaStrategy(ParallelStrategy):
    """Tensor, sequence, pipeline, expert and data parallelism for an unchanged LightningModule.

    Every option in full: docs/options.md.

    Args:
        tp: tensor-parallel size: ranks that split each layer.
        pp: pipeline-parallel size: stages of contiguous blocks.
        sp: sequence parallelism: norms, dropout and the residual stream on sequence shards (needs tp > 1).
        cp: context parallelism: each of cp ranks holds two load-balanced chunks of every sequence.
        cp_attention: how attention sees the whole sequence under cp: "ring" (K/V passed around) or "all_to_all".
        ep: expert parallelism: mixture-of-experts experts split over ep ranks of a stage (its tp x cp x dp, tp first).
        etp: expert tensor parallelism: each expert's MLP split over etp tp ranks (1: whole; a divisor of tp; below tp with ep > 1).
        moe_capacity: capacity factor: each expert keeps at most its share x factor of a rank's tokens (None: dropless).
        zero: 1 shards the optimizer state over data-parallel ranks; 3 parameters and gradients too (FSDP2); 0 none.
        plan: "auto" (a built-in plan by module class), or a lightning_tp.Plan / dict of yours.
        microbatches: microbatches per batch under a pipeline (default: pp); must divide the batch size.
        schedule: "gpipe", "1f1b", "interleaved_1f1b" or "zb_h1".
        virtual_stages: model chunks per rank for the interleaved schedule.
        pipeline_blocks: path of the repeated block list (an encoder-decoder's two, as a list).
        stage_layers: blocks per (virtual) stage, instead of the parameter-balanced split.
        activation_checkpointing: recompute in backward: True every block, n the first n of each stage, "selective" attention cores.
        zb_keep_recomputed: with a split backward and checkpointing: recompute once, in B, and keep it for W.
        split_backward: input gradient first, weights after: "auto" (drain at pp > 1), "drain", True, False.
        p2p: pipeline transfers: "auto", "eager" (gloo) or "batched" (NCCL).
        kernels: fused Triton norms, GeLU, cross-entropy and HF rotary (True, or a list of names).
        quant: quantization-aware training: "int8" (W8A8) or "w4a8".
        quant_range: QAT activation ranges: "ema", "delayed" or "learned".
        load_full: a plain checkpoint (Lightning, state_dict, Hugging Face directory) to start from.
        async_save: write checkpoints in the background: saving returns once this rank's tensors are copied.
        resume: fit without ckpt_path resumes from the newest complete checkpoint: "auto" when a launcher restarted the job, True always, False never.
        sync_init: broadcast rank 0's initial weights before sharding.
        broadcast_batch: every tp/pp rank of a replica trains on its first rank's batch.
        process_group_backend: "gloo" on CPU and "nccl" on GPU by default.
        timeout: collective timeout (a timedelta or seconds).
        hang_timeout: seconds a rank may send no heartbeat (stopped, frozen, gone) before every rank stops, naming it (None: off).
        start_method: "popen" (re-run the script, like DDP), "spawn", "fork" or "forkserver".
    """

    strategy_name = "mega"

    def __init__(self, tp: int = 1, pp: int = 1, sp: bool = False, cp: int = 1,
                 cp_attention: Literal["ring", "all_to_all"] = "ring", ep: int = 1, etp: int = 1,
                 moe_capacity: Optional[float] = None, zero: Literal[0, 1, 3] = 0, plan: Any = "auto",
                 microbatches: Optional[int] = None, schedule: str = "1f1b", virtual_stages: int = 1,
                 pipeline_blocks: Optional[Union[str, list[str]]] = None, stage_layers: Optional[list] = None,
                 activation_checkpointing: Union[bool, int, Literal["selective"]] = False,
                 zb_keep_recomputed: bool = False,
                 split_backward: Union[bool, Literal["auto", "drain"]] = "auto",
                 p2p: Literal["auto", "eager", "batched"] = "auto",
                 kernels: Union[bool, list, None] = False, quant: Optional[str] = None, quant_range: str = "ema",
                 load_full: Optional[str] = None, async_save: bool = False, resume: Union[bool, Literal["auto"]] = "auto",
                 sync_init: bool = True, broadcast_batch: bool = True,
                 process_group_backend: Optional[str] = None,
                 timeout: Optional[Union[timedelta, float]] = default_pg_timeout,
                 hang_timeout: Optional[float] = 300.0,
                 start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
                 accelerator=None, parallel_devices=None, cluster_environment=None, checkpoint_io=None,
                 precision_plugin=None) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        self.config = ParallelConfig.resolve(
            tp=tp, pp=pp, sp=sp, cp=cp, cp_attention=cp_attention, ep=ep, etp=etp, moe_capacity=moe_capacity, zero=zero,
            microbatches=microbatches,
            schedule=schedule, virtual_stages=virtual_stages,
            split_backward=split_backward, pipeline_blocks=pipeline_blocks, stage_layers=stage_layers,
            activation_checkpointing=activation_checkpointing, zb_keep_recomputed=zb_keep_recomputed, p2p=p2p,
            kernels=kernels, quant=quant, quant_range=quant_range, load_full=load_full, plan=plan,
            sync_init=sync_init, broadcast_batch=broadcast_batch)
        if sp and not self.config.sp:
            rank_zero_warn("MegaStrategy(sp=True) needs tp > 1; sequence parallelism is off for tp=1.")
        self._runner = None
        self._grads = None  # how gradients cross dp: zero=0, 1 or 3 (see .dp.sync), made with the mesh
        self._process_group_backend = process_group_backend
        self._timeout = timedelta(seconds=timeout) if isinstance(timeout, (int, float)) else timeout
        self._start_method = start_method
        self._num_nodes = 1
        self._sync_grads = True
        self._batch_broadcast = None
        self._failures = None  # this run's notes of which rank failed first (see .failures)
        self._hang_timeout = hang_timeout
        self._requeue = None  # SLURM's requeue signal held until every rank is at one batch (see .requeue)
        self._context = None  # cp > 1: the context-parallel run (see .context)
        self._writer = ckpt.AsyncWriter(self._timeout) if async_save else None
        if hang_timeout is not None and (isinstance(hang_timeout, bool) or not (isinstance(hang_timeout, (int, float))
                                           and hang_timeout > 0)):
            raise ValueError(f"MegaStrategy(hang_timeout={hang_timeout!r}): give seconds > 0 (how long a rank may send no "
                             f"heartbeat before every rank stops), or None to turn the watch off.")
        if resume not in ("auto", True, False):
            raise ValueError(f"MegaStrategy(resume={resume!r}): choose 'auto' (when torchrun or SLURM restarted the "
                             f"job), True or False.")
        self._resume = resume
        self.mesh: ParallelMesh = ParallelMesh()

    # ------------------------------------------------------------------ topology

    @property
    def tp(self) -> int:
        return self.config.tp

    @property
    def pp(self) -> int:
        return self.config.pp

    @property
    def sp(self) -> bool:
        return self.config.sp

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
    def step_microbatches(self) -> int:
        """Microbatches of the current (or last) step: ``microbatches``, except on a batch it does not
        divide (an epoch's smaller last batch, see pipeline/run/microbatch.py); 1 without a pipeline.
        A sum-reduced loss multiplied by it gives the whole batch's sum."""
        return self._runner.step_m if self._runner is not None else 1

    @property
    def is_distributed(self) -> bool:
        return True  # tells Lightning to add a DistributedSampler (with the dp rank/size below)

    @property
    def distributed_sampler_kwargs(self) -> dict:
        """Only data-parallel ranks see different data; tp/pp ranks of one replica see the same batch."""
        return {"num_replicas": self.mesh.dp, "rank": self.mesh.dp_rank}

    def process_dataloader(self, dataloader):
        """torch's own DataLoader made resumable mid-epoch (see .resumable_data)."""
        def progress():  # batches of this epoch trained, and dp, as a checkpoint is saved
            return self.lightning_module.trainer.fit_loop.epoch_loop.batch_progress.current.processed, self.mesh.dp
        return resumable(super().process_dataloader(dataloader), progress)

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
        if self.root_device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            # like torchrun: N processes on one machine share its cores (idle pipeline stages would
            # otherwise spin their thread pools against the busy ones)
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, self.num_processes)))
        self.config = self.config.with_world(self.num_nodes * self.num_processes)  # before any collective
        reset_seed()
        self.set_world_ranks()
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        self._process_group_backend = backend
        store = attempt_store(self.cluster_environment, self.global_rank, self.world_size, self._timeout)
        _init_dist_connection(self.cluster_environment, backend, timeout=self._timeout,
                              **({"store": store} if store is not None else {}))
        self.mesh = build_mesh(self.tp, self.pp, device_type=self.root_device.type, ep=self.config.ep,
                               etp=self.config.etp, timeout=self._timeout, cp=self.config.cp)
        self._failures = FailureNotes.open(self.mesh, hang=self._hang_timeout)
        if self.config.broadcast_batch and comm.group_size(self.mesh.replica_group) > 1:
            cpu_group = self.mesh.replica_group if backend == "gloo" else gloo_twin_of_replica_group(self.mesh)
            self._batch_broadcast = BatchBroadcast(self.mesh.replica_group,
                                                   self.mesh.global_rank(0, self.mesh.dp_rank, 0),
                                                   self.root_device, cpu_group)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    # ------------------------------------------------------------------ model

    def setup(self, trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING and (self._resume is True or (self._resume == "auto" and restarted())):
            self._resume_newest(trainer)
        module = self.lightning_module
        reused = getattr(module, "_lightning_tp", None) is not None
        self._runner = parallelize(self.config, self.mesh, module, self.root_device)
        self._context = module._lightning_tp.context
        context_runtime.activate(self._context)  # cp > 1: torch's attention context-parallel (else torch's own)
        if self._grads is None:
            self._grads = GradSync(self.config, self.mesh, lambda: self._sync_grads)
        self._grads.attach(module, self._runner, reused)
        if self._runner is not None:
            install_epoch_end_sync(trainer, self._runner)
        copy_averaged_models_again(trainer, self.lightning_module)
        self.model = self.precision_plugin.convert_module(self.model)
        for twin in self.lightning_module._lightning_tp.twins:  # placeholders' zeros in the model's dtype
            self.precision_plugin.convert_module(twin)
        self.model_to_device()
        self._grads.shard_module(module, module._lightning_tp.places)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            raise_on_every_rank("configure_optimizers", lambda: self.setup_optimizers(trainer), self.global_rank,
                                self.root_device, self.mesh.pp_rank if self.pp > 1 else None)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)
            self._grads.shard_optimizers(self.optimizers, module)
        self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_norm
        scaler = getattr(self.precision_plugin, "scaler", None)
        if scaler is not None and (self.tp * self.pp > 1 or self._grads.sharded):  # fp16 AMP: one skip-or-step decision
            # for all (under zero=1/3 each dp rank unscales only its slices)
            grads.agree_on_overflow(scaler)

    def _resume_newest(self, trainer) -> None:
        """Where fit was given no ckpt_path: the newest complete checkpoint in ModelCheckpoint's directory or
        the root directory (rank 0's choice, for every rank), handed to Lightning's restore after setup."""
        connector = trainer._checkpoint_connector
        restore = connector._restore_modules_and_callbacks

        def restore_newest(checkpoint_path=None, weights_only=None):
            if checkpoint_path is None:
                dirs = [getattr(cb, "dirpath", None) for cb in trainer.checkpoint_callbacks] + [trainer.default_root_dir]
                found = newest_complete(dirs) if self.is_global_zero else None
                saved_dp = ckpt.read_meta(found)["lightning_tp"].get("dp") if found is not None else None
                checkpoint_path, saved_dp = self.broadcast((str(found), saved_dp) if found is not None else (None, None))
                if checkpoint_path is not None:
                    rank_zero_warn(f"MegaStrategy(resume={self._resume!r}): resuming from {checkpoint_path}, the newest "
                                   f"complete checkpoint" + (" (the job was restarted)" if restarted() else ""))
                    keep_global_batch(trainer, saved_dp, self.mesh.dp)
            connector._restore_modules_and_callbacks = restore  # once
            return restore(checkpoint_path, weights_only)

        connector._restore_modules_and_callbacks = restore_newest

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def batch_to_device(self, batch, device=None, dataloader_idx: int = 0):
        """After the move (and ``on_after_batch_transfer``), every tp/pp rank of a replica takes its
        first rank's batch: random augmentation must not differ between the ranks of one model."""
        batch = super().batch_to_device(batch, device, dataloader_idx)
        batch = self._batch_broadcast(batch) if self._batch_broadcast is not None else batch
        return self._context.cut(batch) if self._context is not None else batch  # cp: this rank's chunks

    # ------------------------------------------------------------------ pipeline steps

    @property
    def runner(self):
        """The pipeline runner (pp > 1 or microbatches > 1), else None."""
        return self._runner

    def training_step(self, *args, **kwargs):
        if self._grads.fsdp:  # through the module's call, which runs FSDP2's hooks
            with self.precision_plugin.train_step_context():
                return self._forward_redirection(self.model, self.lightning_module, "training_step", *args, **kwargs)
        if self._runner is None:
            out = super().training_step(*args, **kwargs)
            return self._context_averaged(out) if self._context is not None else out
        if not self.lightning_module.automatic_optimization:
            raise ValueError("MegaStrategy(pp>1 or microbatches>1) needs automatic optimization.")
        batch, rest, batch_idx = _step_args(args, kwargs, self.lightning_module.trainer.fit_loop.epoch_loop.batch_idx)
        scale = 1.0 / self.lightning_module.trainer.accumulate_grad_batches  # the runner divides by the microbatches
        scaler = getattr(self.precision_plugin, "scaler", None)
        if scaler is not None:  # fp16 AMP: the backward runs in the step, so the loss scaling goes there too
            scale = scaler.scale(torch.ones((), device=self.root_device)) * scale  # device ops only, no host sync
        with self.precision_plugin.train_step_context():
            try:
                loss = self._runner.train_step(batch, batch_idx, scale, rest)
            except StopIteration as e:  # Lightning's loop would take it for this rank's end of epoch, alone
                raise RuntimeError(f"StopIteration raised inside the pipelined training step (stage "
                                   f"{self.mesh.pp_rank}): {e!r}") from e
        loss = torch.tensor(loss, device=self.root_device)
        if self._context is not None:
            loss = self._context_averaged(loss)
        extras = self._runner.step_extras  # a dict step's other keys (last stage), merged over microbatches
        return {"loss": loss, **extras} if extras else loss

    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        trainer = self.lightning_module.trainer
        if self._failures is not None:  # what the heartbeat says this rank was doing
            self._failures.at_step(trainer.global_step)
        if self._requeue is None:  # Lightning sets its signal handlers after setup
            self._requeue = DeferredRequeue(trainer, self.root_device)
            self._requeue.install()
        self._requeue.at_batch()  # SLURM's requeue signal: Lightning's hpc save, on every rank at one batch

    def _context_averaged(self, out):
        """cp: the step's loss reported as the mean over the cp ranks (each computed its own tokens'), after
        checking on the first step that attention went through the context-parallel path."""
        run = self._context
        run.check_attention("training_step")
        if isinstance(out, dict) and "loss" in out:
            return {**out, "loss": run.averaged(out["loss"])}
        return run.averaged(out)

    def _eval_step(self, hook, context, *args, **kwargs):
        if self._context is None:
            return self._eval_step_plain(hook, context, *args, **kwargs)
        if hook == "predict_step":
            raise ValueError(f"MegaStrategy(cp={self.config.cp}): predict_step would return each rank's two chunks of "
                             f"every sequence, not the sequence; predict with cp=1.")
        try:
            out = self._eval_step_plain(hook, context, *args, **kwargs)
            self._context.check_attention(hook)
            return out
        finally:
            self._context.done()

    def _eval_step_plain(self, hook, context, *args, **kwargs):
        if self._grads.fsdp:
            with context():
                return self._forward_redirection(self.model, self.lightning_module, hook, *args, **kwargs)
        if self._runner is None:
            return getattr(super(), hook)(*args, **kwargs)
        batch, rest, batch_idx = _step_args(args, kwargs, 0)
        with context():
            return self._runner.eval_step(hook, batch, batch_idx, rest)

    def validation_step(self, *args, **kwargs):
        return self._eval_step("validation_step", self.precision_plugin.val_step_context, *args, **kwargs)

    def test_step(self, *args, **kwargs):
        return self._eval_step("test_step", self.precision_plugin.test_step_context, *args, **kwargs)

    def predict_step(self, *args, **kwargs):
        return self._eval_step("predict_step", self.precision_plugin.predict_step_context, *args, **kwargs)

    def backward(self, closure_loss, optimizer, *args, **kwargs):
        """Under a pipeline the backward already ran inside the step: hand over its gradients."""
        if self._runner is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        self._grads.merge_pipeline_grads(self.lightning_module)
        closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
        self.post_backward(closure_loss)
        return closure_loss

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
        if self._context is not None:  # the forward and its recomputation are over: outside steps torch's own
            self._context.done()
        streams = getattr(getattr(self.lightning_module, "_lightning_tp", None), "streams", None)
        if streams is not None:  # a refusal made while recomputing, which torch only warned about
            streams.raise_pending()
        if self._sync_grads:  # manual optimization may sync several times before its optimizer step
            self._grads.sync(self.lightning_module.parameters(), repeated=not self.lightning_module.automatic_optimization)

    def optimizer_step(self, optimizer, closure, model=None, **kwargs):
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._grads.after_step(optimizer, self.lightning_module.automatic_optimization)
        return out

    def _clip_grad_by_norm(self, optimizer, clip_val) -> None:
        self._grads.clip(optimizer, float(clip_val), self.root_device)  # a rank without gradients (frozen stage) too

    # ------------------------------------------------------------------ collectives for Lightning

    def reduce(self, tensor, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean"):
        """``self.log(..., sync_dist=True)`` lands here: reduce over data-parallel replicas only."""
        group = group if group is not None else self.mesh.dp_group
        if isinstance(tensor, torch.Tensor) and comm.group_size(group) > 1:
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    def all_gather(self, tensor, group: Optional[Any] = None, sync_grads: bool = False):
        """``self.all_gather`` gathers over data-parallel replicas only: tp and pp ranks of one replica
        hold the same samples (DDP's shape: (dp, ...))."""
        if group is None or group is dist.group.WORLD:  # LightningModule.all_gather passes WORLD
            group = self.mesh.dp_group
        return _all_gather_ddp_if_available(tensor, group=group, sync_grads=sync_grads)

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

    def optimizer_state(self, optimizer) -> dict:
        """A zero=1 optimizer's state is saved from its slices by each rank (see .checkpoints): nothing gathered."""
        inner = getattr(optimizer, "_optimizer", optimizer)
        if getattr(inner, "_lightning_tp_zero", None) is not None:
            return {ckpt.layout_free.ZERO_SLICES: True}
        return super().optimizer_state(optimizer)

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options: Optional[Any] = None) -> None:
        ckpt.save(checkpoint, self.broadcast(str(filepath)), self.mesh, self.lightning_module, self.optimizers,
                  self.barrier, self.broadcast, writer=self._writer)

    def load_checkpoint(self, checkpoint_path, weights_only: Optional[bool] = None) -> dict:
        if self._writer is not None:
            self._writer.wait()
        path = self.broadcast(str(checkpoint_path))
        found = ckpt.kind(path)
        if found == "lightning_tp":
            return ckpt.load(path, self.mesh, self.lightning_module, self.optimizers, self.root_device)
        if found in ("lightning_dcp", "deepspeed"):
            other = "DeepSpeedStrategy" if found == "deepspeed" else "FSDP or ModelParallelStrategy"
            raise ValueError(f"{path} is a checkpoint of Lightning's {other}: MegaStrategy resumes its own "
                             f"checkpoints only. Start from its weights with MegaStrategy(load_full={str(path)!r}) "
                             f"instead of ckpt_path (the optimizer starts afresh).")
        raise ValueError(f"{path} is not a lightning_tp checkpoint directory. To start a parallel run from a plain "
                         f"checkpoint, pass MegaStrategy(load_full={str(path)!r}) instead of ckpt_path.")

    def remove_checkpoint(self, filepath) -> None:
        if self.is_global_zero:
            self.checkpoint_io.remove_checkpoint(filepath)

    def on_exception(self, exception: BaseException) -> None:
        """Note this rank's error for the others; to an error that only says another rank went away
        (gloo's "Connection closed by peer"), add the first error noted (see :mod:`.failures`)."""
        if self._failures is not None:
            self._failures.record(exception)
            self._failures.explain(exception)
        super().on_exception(exception)

    def teardown(self) -> None:
        """The batch broadcast's source waits for its last sends: a gloo broadcast still in flight when
        the process exits aborts it ("terminate called without an active exception")."""
        if self._batch_broadcast is not None:
            self._batch_broadcast.finish()
        if self._writer is not None:  # the last checkpoint in place before the processes go
            self._writer.wait()
        if self._failures is not None:
            self._failures.close()
        if self._requeue is not None:
            self._requeue.close()
            self._requeue = None
        if self._context is not None:
            context_runtime.activate(None)
        if self._grads is None or not self._grads.fsdp:
            return super().teardown()
        # zero=3, as Lightning's ModelParallelStrategy: the module stays where it is (moving FSDP2's DTensors
        # would make new parameter objects, apart from the optimizer's and without their marks)
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register("mega", cls, description="lightning-tp: tensor, sequence, pipeline, data parallelism")
