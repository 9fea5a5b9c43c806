"""Make a user's module this rank's part of the layout a MegaStrategy asks for, in one fixed order, the
same on every rank (every check first). See docs/design/strategy.md."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from .dp import grads
from .recompute import full as recompute, selective
from .config import ModelChoices, ParallelConfig
from .layout import resolve_layout
from .context.runtime import ContextParallel
from .experts.router_losses import carry as router_carry
from .experts.apply import apply_experts, rebind_experts
from .kernels.inject import apply_kernels
from .layers.attention import TPMultiheadAttention
from .layers.linear import ColumnParallelLinear, RowParallelLinear
from .mesh import use_tied_ranks
from .pipeline.cut.block_lists import block_at, block_key, called_parts
from .pipeline.run.executor import PipelineRunner
from .pipeline.cut.placeholders import meta_twins
from .tp_in_pp.sharded_twins import shard_twins
from .pipeline.run.side_inputs import SideInputCheck
from .tp_in_pp import sp_stages
from .pipeline.cut.split import Cut, apply_split
from .pipeline.run.stage import install as install_stages
from .checkpoints.plain import load_full
from .plans import lookup, swap
from .quant import apply_qat
from .recompute.rng import BlockStreams


def _batched(config) -> bool:
    """Pipeline transfers grouped per time slot (``p2p="batched"``, or auto on NCCL)."""
    return config.p2p == "batched" or (config.p2p == "auto" and on_nccl())


def on_nccl() -> bool:
    """Whether NCCL carries the transfers ("nccl", or a per-device backend string naming it)."""
    return "nccl" in dist.get_backend()


@dataclass
class Parallelized:
    """What :func:`parallelize` did to a module (``module._lightning_tp``): its layout and run-time parts."""

    config: ParallelConfig
    choices: ModelChoices
    contexts: list
    runner: Optional[PipelineRunner]
    tied_ranks: tuple
    twins: list
    streams: Optional[BlockStreams]
    context: Optional[ContextParallel] = None  # cp > 1: the cp run (see .context)
    places: Optional[list] = None  # (list path, index) of this rank's blocks (see layout.block_places)


def parallelize(config: ParallelConfig, mesh, module, device):
    """Make ``module`` this rank's part of ``config``'s layout on ``mesh``. Returns the pipeline runner or None;
    a module parallelized before keeps its layout and takes ``mesh``'s groups. Gradients: dp.sync.GradSync."""
    _share_groups_in_copies()
    done = getattr(module, "_lightning_tp", None)
    if done is not None:
        return _reuse(config, mesh, module, done, device)
    # 1. every check, on every rank alike, before any collective (no change to the module either)
    plan = resolve_layout(config, module, mesh.pp_rank, nccl=config.pipelined and on_nccl())
    layout, matches, declared, carried = plan.stages, plan.matches, plan.expert_styles, plan.carried
    # 2. one set of initial weights, then keep this rank's stage and shards
    if config.sync_init and mesh.world_size > 1:
        _broadcast_initial_weights(module, device)
    if plan.hf_checkpointing:
        _take_over_hf_checkpointing(plan.hf_checkpointing)
    split = apply_split(module, layout, mesh.pp_rank) if config.pp > 1 else Cut()
    tied_ranks = layout.replica_ranks() if config.pp > 1 and layout.lists else ()
    if len(tied_ranks) > 1:
        use_tied_ranks(mesh, tied_ranks)
    apply_experts(module, mesh, config.pp, config.sp, config.moe_capacity, declared)
    # under a pipeline a stage cannot tell the next one to leave SP for a forward: no fallback
    replaced = swap.apply(module, matches, mesh.tp_group, config.tp, mesh.tp_rank, config.sp, sp_fallback=config.pp == 1)
    if config.pp > 1 and config.tp > 1:
        shard_twins(module, layout, split, matches, config.tp, mesh.tp_rank)
    apply_kernels(module, config.kernels)
    if config.quant is not None:
        apply_qat(module, config.quant, tp_group=mesh.tp_group, dp_group=mesh.dp_group, act_range=config.quant_range)
    if config.load_full is not None:
        load_full(module, config.load_full, plan.full_keys, mesh.tp_rank)
    recompute.apply(module, plan.recomputed, split=config.pipelined and config.zb_keep_recomputed)  # in the stage wrappers
    selective.apply(selective.blocks_at(module, plan.selected), plan.core)
    runner = None
    if config.pipelined:
        silence = [(module.get_submodule(name), twin, runs) for name, (twin, runs) in split.silence.items()]
        side = SideInputCheck.for_mesh(mesh, layout.pp) if config.pp > 1 else None
        state = install_stages(layout.blocks(module), layout, mesh.pp_rank, silence, split.twins, side,
                               split.companion_twins)
        state.device = device
        if carried is not None:
            router_carry.install(module, state, carried, mesh.dp_group, config.pp,
                                 mesh.tp_group if config.sp and config.tp > 1 else None, declared)
        runner = PipelineRunner(module, mesh, layout, state, config.schedule, config.microbatches,
                                batched=_batched(config), device=device, split_backward=plan.choices.split_backward)
    streams = _block_streams(config, mesh, module, layout, plan.places, device)
    contexts = {id(m.ctx): m.ctx for m in replaced.values() if hasattr(m, "ctx")}
    if config.pp > 1:
        sp_stages.install(layout, runner.state, matches, contexts.values(), config.tp)
    context = ContextParallel(mesh, config.cp_attention) if config.cp > 1 else None
    if context is not None:
        context.install(module)
    module._lightning_tp = Parallelized(config, plan.choices, list(contexts.values()), runner, tied_ranks,
                                        meta_twins(module, split) if config.pp > 1 else [], streams, context,
                                        plan.places)
    _set_metric_groups(module, mesh.dp_group)
    return runner


def _reuse(config, mesh, module, done: Parallelized, device):
    """A module parallelized before: the same layout, the new strategy's groups."""
    old = done.config
    if (old.tp, old.sp, old.pp, old.cp, old.ep, old.etp, old.moe_capacity, old.activation_checkpointing,
            old.selective) != (config.tp, config.sp, config.pp, config.cp, config.ep, config.etp, config.moe_capacity,
                               config.activation_checkpointing, config.selective):
        raise ValueError(f"{type(module).__name__} was already parallelized with tp={old.tp}, sp={old.sp}, "
                         f"pp={old.pp}, cp={old.cp}, ep={old.ep}, etp={old.etp}, moe_capacity={old.moe_capacity}, "
                         f"activation_checkpointing={old.activation_checkpointing}; build a fresh module for this "
                         f"layout.")
    rebind_experts(module, mesh, config.pp, lookup.expert_styles(config.plan))
    if done.context is not None:  # the same hooks, the new strategy's groups
        done.context = ContextParallel(mesh, config.cp_attention)
    for ctx in done.contexts:
        ctx.group = mesh.tp_group
    if len(done.tied_ranks) > 1:
        use_tied_ranks(mesh, done.tied_ranks)
    runner = done.runner
    if (runner is None) == config.pipelined or (runner is not None and runner.layout.v != config.virtual_stages):
        raise ValueError(f"{type(module).__name__} was already parallelized "
                         f"{'without a pipeline' if runner is None else f'with virtual_stages={runner.layout.v}'}; "
                         f"build a fresh module for this layout.")
    batched = _batched(config)
    split = config.for_model(done.choices.hf_recompute, bool(runner.layout.lists)).split_backward \
        if runner is not None else False
    if runner is not None and (runner.schedule, runner.m, runner.batched, runner.split_backward) != \
            (config.schedule, config.microbatches, batched, split):
        # another schedule or microbatch count on the same stages (a second Trainer's options)
        runner = done.runner = PipelineRunner(module, mesh, runner.layout, runner.state, config.schedule,
                                              config.microbatches, batched=batched, device=device,
                                              split_backward=split)
    if runner is not None:
        runner.mesh = mesh
        runner.dp_overlap = None  # the last strategy's; this one syncs after the step
        runner.new_run()
    return runner


def _take_over_hf_checkpointing(modules) -> None:
    """Hugging Face's gradient checkpointing wraps a block's whole call, the stage's substitution of
    the received activation included: under a pipeline it is switched off and each of this rank's
    blocks recomputes with ours instead, inside the stage wrappers."""
    for m in modules:
        m.gradient_checkpointing = False
    from lightning.pytorch.utilities import rank_zero_warn

    rank_zero_warn("Hugging Face gradient checkpointing under a pipeline is done by MegaStrategy's own recompute "
                   "(as activation_checkpointing=True): each block of a stage recomputes its forward in its "
                   "backward, inside the stage.")


def _block_streams(config, mesh, module, layout, found, device):
    """tp/pp > 1: this rank's blocks (``found``: their places) draw from their own random streams (see
    :mod:`.recompute.rng`), seeded from global rank 0's seed. None without a block list."""
    if config.tp == 1 and config.pp == 1:
        return None
    seed = torch.tensor([torch.initial_seed() & ((1 << 63) - 1)], dtype=torch.int64, device=device)
    dist.broadcast(seed, src=0)
    if found is None:  # no block list (only without a pipeline)
        if config.tp > 1 and any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in module.modules()):
            from lightning.pytorch.utilities import rank_zero_warn

            rank_zero_warn(f"{type(module).__name__} has dropout but no repeated block list was found: under "
                           f"tp its split activations draw alike masks on every rank. Name the list with "
                           f"MegaStrategy(pipeline_blocks='path.to.blocks') for a stream per rank.")
        return None
    blocks = [(f"{path}.{block_key(module.get_submodule(path), i)}", block_at(module.get_submodule(path), i))
              for path, i in found]
    if layout is not None:  # modules of lists walked with the blocks (zip) run with them
        blocks += [(f"{c}.{i}", module.get_submodule(c)[i]) for c in layout.companions for _, i in found]
    blocks = [(f"{name}.{sub}" if sub else name, part) for name, b in blocks for sub, part in called_parts(b)]
    inner = [m for _, b in blocks for m in b.modules()]
    enters = [(m, isinstance(m, TPMultiheadAttention)) for m in inner
              if isinstance(m, TPMultiheadAttention) or (isinstance(m, ColumnParallelLinear) and m.gather_output is False)]
    leaves = [m for m in inner if isinstance(m, RowParallelLinear)]
    streams = BlockStreams(int(seed.item()), mesh.pp_rank, mesh.tp_rank, config.sp, device)
    streams.install(module, blocks, enters, leaves)
    return streams


def _share_groups_in_copies() -> None:
    """A copy of a parallelized module (an EMA, SWA's average, ``copy.deepcopy`` in the user's code)
    uses the same process groups: they hold connections and cannot be copied (deepcopy raised)."""
    for kind in (dist.ProcessGroup, getattr(dist, "Store", None)):
        if kind is not None and "__deepcopy__" not in kind.__dict__:
            kind.__deepcopy__ = lambda self, memo: self


def _broadcast_initial_weights(module, device) -> None:
    """Rank 0's initial weights everywhere, in flat buckets on the run's device (NCCL needs it there;
    the module itself moves only later)."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    tensors = [t.data for t in list(module.parameters()) + list(module.buffers())]
    for bucket in grads.chunked(tensors):
        flat = _flatten_dense_tensors(bucket).to(device)
        dist.broadcast(flat, src=0)
        for t, synced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
            t.copy_(synced)
        if all(t.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr() for t in bucket):
            flat.untyped_storage().resize_(0)  # freed now: gloo's worker thread keeps its last work's tensors


def _set_metric_groups(module, dp_group) -> None:
    """torchmetrics sync over data-parallel replicas only: tp and pp ranks of one replica hold the same samples."""
    try:
        from torchmetrics import Metric
    except ImportError:  # pragma: no cover
        return
    for m in module.modules():
        if isinstance(m, Metric):
            m.process_group = dp_group

