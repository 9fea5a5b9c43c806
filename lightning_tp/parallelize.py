"""Make a user's module this rank's part of the layout a MegaStrategy asks for.

One fixed order, the same on every rank: every check first (a bad layout fails on all ranks before
any collective), then one set of initial weights, then this rank's pipeline stage, its tensor-parallel
shards, fused kernels, quantization-aware layers, its part of a full checkpoint, recomputation, the
stage wrappers and the pipeline runner. A module parallelized before (a second ``fit``, ``validate``
after ``fit``) keeps its layout and is pointed at the new strategy's groups.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import grads, recompute
from .dp_overlap import DPOverlap
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
from .pipeline.cut.split import apply_split, plan_stages
from .pipeline.schedule.schedules import resolve_split_backward
from .pipeline.run.stage import install as install_stages
from .plain import load_full
from .plans import apply as planner
from .quant import apply_qat
from .rng import BlockStreams


def _batched(s) -> bool:
    """Pipeline transfers grouped per time slot (``p2p="batched"``, or auto on NCCL)."""
    return s.p2p == "batched" or (s.p2p == "auto" and on_nccl())


def on_nccl() -> bool:
    """Whether NCCL carries the transfers ("nccl", or a per-device backend string naming it)."""
    return "nccl" in dist.get_backend()


def parallelize(s, module):
    """``s``: the MegaStrategy (its options and mesh). Returns (pipeline runner or None, dp overlap or
    None) and records the layout on ``module._lightning_tp``."""
    _share_groups_in_copies()
    done = getattr(module, "_lightning_tp", None)
    if done is not None:
        return _reuse(s, module, done), s._dp_overlap
    # 1. every check, on every rank alike, before any collective
    check_p2p_backend(s)
    matches = planner.resolve(module, s.tp, s.sp, s.plan) if s.tp > 1 else []
    layout = None
    if s.pp > 1:
        blocks = s.pipeline_blocks or planner.blocks_path(module, s.plan)
        layout = plan_stages(module, s.pp, s.virtual_stages, blocks, s.stage_layers,
                             interleaved=s.schedule == "interleaved_1f1b")
    elif s._pipelined:  # microbatching without stages: one stage holding every block
        layout = plan_stages(module, 1, 1, s.pipeline_blocks or planner.blocks_path(module, s.plan))
    hf_taken = s.pp > 1 and _take_over_hf_checkpointing(module, s, layout)
    recompute_n = s.activation_checkpointing or hf_taken
    recomputed = recompute.targets(module, recompute_n, layout, s.mesh.pp_rank,
                                   s.pipeline_blocks or _plan_blocks(module, s.plan)) if recompute_n else []
    full_keys = list(module.state_dict().keys())
    # 2. one set of initial weights, then keep this rank's stage and shards
    if s.sync_init and s.mesh.world_size > 1:
        _broadcast_initial_weights(module, s.root_device)
    split = apply_split(module, layout, s.mesh.pp_rank) if s.pp > 1 else {"silence": {}, "twins": {}}
    tied_ranks = layout.replica_ranks() if s.pp > 1 and layout.lists else ()
    if len(tied_ranks) > 1:
        use_tied_ranks(s.mesh, tied_ranks)
    replaced = planner.apply(module, matches, s.mesh.tp_group, s.tp, s.mesh.tp_rank, s.sp)
    if s.pp > 1 and s.tp > 1:
        shard_twins(module, layout, split, matches, s.tp, s.mesh.tp_rank)
    apply_kernels(module, s.kernels)
    if s.quant is not None:
        apply_qat(module, s.quant, tp_group=s.mesh.tp_group, dp_group=s.mesh.dp_group, act_range=s.quant_range)
    if s.load_full is not None:
        load_full(module, s.load_full, full_keys, s.mesh.tp_rank)
    recompute.apply(module, recomputed, split=s._pipelined and s.zb_keep_recomputed)  # inside the stage wrappers below
    runner = None
    if s._pipelined:
        silence = [(module.get_submodule(name), twin, runs) for name, (twin, runs) in split["silence"].items()]
        side = SideInputCheck.for_mesh(s.mesh, layout.pp) if s.pp > 1 else None
        state = install_stages(layout.blocks(module), layout, s.mesh.pp_rank, silence, split["twins"], side,
                               split.get("companion_twins"))
        runner = PipelineRunner(module, s.mesh, layout, state, s.schedule, s.microbatches, batched=_batched(s),
                                device=s.root_device, split_backward=_split_backward(s, layout, recompute_n))
    streams = _block_streams(s, module, layout)
    overlap = _dp_overlap(s, module, runner)
    contexts = {id(m.ctx): m.ctx for m in replaced.values() if hasattr(m, "ctx")}
    for ctx in contexts.values():  # a stage cannot tell the next one to leave SP for a forward
        ctx.sp_fallback = s.pp == 1
    if s.pp > 1:
        sp_stages.install(layout, runner.state, matches, contexts.values(), s.tp)
    module._lightning_tp = {"tp": s.tp, "sp": s.sp, "pp": s.pp, "contexts": list(contexts.values()),
                            "runner": runner, "recompute": s.activation_checkpointing, "hf_recompute": hf_taken,
                            "tied_ranks": tied_ranks, "twins": meta_twins(module, split) if s.pp > 1 else [],
                            "streams": streams}
    _set_metric_groups(module, s.mesh.dp_group)
    return runner, overlap


def _split_backward(s, layout, recomputes):
    """The strategy's ``split_backward`` for this layout (``"auto"`` made concrete); ``recomputes``:
    blocks are recomputed (``activation_checkpointing``, or Hugging Face's taken over)."""
    return resolve_split_backward(s.split_backward, s.schedule, s.pp, recomputes, bool(layout.lists))


def _reuse(s, module, done):
    """A module parallelized before: the same layout, the new strategy's groups."""
    if (done["tp"], done["sp"], done["pp"], done["recompute"]) != (s.tp, s.sp, s.pp, s.activation_checkpointing):
        raise ValueError(f"{type(module).__name__} was already parallelized with tp={done['tp']}, sp={done['sp']}, "
                         f"pp={done['pp']}, activation_checkpointing={done['recompute']}; build a fresh module "
                         f"for this layout.")
    for ctx in done["contexts"]:
        ctx.group = s.mesh.tp_group
    if len(done.get("tied_ranks", ())) > 1:
        use_tied_ranks(s.mesh, done["tied_ranks"])
    runner = done["runner"]
    if (runner is None) == s._pipelined or (runner is not None and runner.layout.v != s.virtual_stages):
        raise ValueError(f"{type(module).__name__} was already parallelized "
                         f"{'without a pipeline' if runner is None else f'with virtual_stages={runner.layout.v}'}; "
                         f"build a fresh module for this layout.")
    batched = _batched(s)
    recomputes = s.activation_checkpointing or done.get("hf_recompute", False)
    split = _split_backward(s, runner.layout, recomputes) if runner is not None else False
    if runner is not None and (runner.schedule, runner.m, runner.batched, runner.split_backward) != \
            (s.schedule, s.microbatches, batched, split):
        recompute.check_option(recomputes, s.quant, s.schedule, s.zb_keep_recomputed, split)
        # another schedule or microbatch count on the same stages (a second Trainer's options)
        runner = done["runner"] = PipelineRunner(module, s.mesh, runner.layout, runner.state, s.schedule,
                                                 s.microbatches, batched=batched, device=s.root_device,
                                                 split_backward=split)
    if runner is not None:
        runner.mesh = s.mesh
        runner.dp_overlap = None  # the last strategy's; this one syncs after the step
        runner._trained = False  # a new run: its first batch is checked (see must_divide)
    return runner


def _take_over_hf_checkpointing(module, s, layout) -> bool:
    """Hugging Face's gradient checkpointing wraps a block's whole call, the stage's substitution of
    the received activation included: reentrant (its default), the checkpoint's input is then the
    placeholders' zeros, which need no grad, and a later stage's blocks get no gradient. Under a
    pipeline it is switched off and each of this rank's blocks recomputes with ours instead, which
    sits inside the stage wrappers: the same recompute."""
    lists = [path for path, _ in layout.lists] if layout.lists else [layout.blocks_path]
    near = lambda name: any(name == p or p.startswith(name + ".") or name.startswith(p + ".")  # noqa: E731
                            for p in lists)  # a block, in one, or a parent of a list (not a vision tower)
    on = [m for name, m in module.named_modules() if near(name) and getattr(m, "gradient_checkpointing", False)
          is True and callable(getattr(m, "_gradient_checkpointing_func", None))]
    if not on:
        return False
    recompute.check_option(True, s.quant, s.schedule, s.zb_keep_recomputed, _split_backward(s, layout, True))
    for m in on:
        m.gradient_checkpointing = False
    from lightning.pytorch.utilities import rank_zero_warn

    rank_zero_warn("Hugging Face gradient checkpointing under a pipeline is done by MegaStrategy's own recompute "
                   "(as activation_checkpointing=True): each block of a stage recomputes its forward in its "
                   "backward, inside the stage.")
    return True


def _block_streams(s, module, layout):
    """tp/pp > 1: this rank's blocks draw from their own random streams (see :mod:`.rng`), seeded
    from global rank 0's seed. None where no block list is found (a model without repeated blocks)."""
    if s.tp == 1 and s.pp == 1:
        return None
    seed = torch.tensor([torch.initial_seed() & ((1 << 63) - 1)], dtype=torch.int64, device=s.root_device)
    dist.broadcast(seed, src=0)
    if layout is not None:
        found = [layout.locate(i) for k in layout.vstages_of(s.mesh.pp_rank)
                 for i in range(layout.ranges[k][0], layout.ranges[k][1] + 1)]
    else:
        try:
            found = [(path, i) for path in recompute.block_lists(module, s.pipeline_blocks or _plan_blocks(module, s.plan))
                     for i in range(len(module.get_submodule(path)))]
        except ValueError:
            if s.tp > 1 and any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in module.modules()):
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
    streams = BlockStreams(int(seed.item()), s.mesh.pp_rank, s.mesh.tp_rank, s.sp, s.root_device)
    streams.install(module, blocks, enters, leaves)
    return streams


def _dp_overlap(s, module, runner):
    """dp > 1: the all-reduce of gradients overlapped with the backward (see :mod:`.dp_overlap`)."""
    if s._dp_overlap is not None:
        s._dp_overlap.remove()
    if s.mesh.dp == 1:
        return None
    if runner is None:
        return DPOverlap(module.parameters(), s.mesh.dp_group, s.mesh.dp, armed=lambda: s._sync_grads)
    # a pipeline's backward runs per microbatch: only its last one starts the sync, and only without
    # accumulation over batches (then its tensor is the step's gradient, see merge_grads)
    overlap = DPOverlap(module.parameters(), s.mesh.dp_group, s.mesh.dp, hooked=False,
                        armed=lambda: s._sync_grads and s.lightning_module.trainer.accumulate_grad_batches == 1)
    runner.dp_overlap = overlap
    return overlap


def _share_groups_in_copies() -> None:
    """A copy of a parallelized module (an EMA, SWA's average, ``copy.deepcopy`` in the user's code)
    uses the same process groups: they hold connections and cannot be copied (deepcopy raised)."""
    for kind in (dist.ProcessGroup, getattr(dist, "Store", None)):
        if kind is not None and "__deepcopy__" not in kind.__dict__:
            kind.__deepcopy__ = lambda self, memo: self


def check_p2p_backend(s) -> None:
    """Pipelines on NCCL: what its P2P semantics cannot run yet is refused now, not hung on later."""
    if not s._pipelined or not on_nccl():
        return
    if s.p2p == "eager":
        raise ValueError("MegaStrategy(p2p='eager') posts receives ahead, which NCCL queues in front of later "
                         "sends on the same stream (a deadlock); use p2p='auto' or 'batched' on GPUs.")


def _broadcast_initial_weights(module, device) -> None:
    """Rank 0's initial weights everywhere, in flat buckets on the run's device (NCCL needs it there;
    the module itself moves only later)."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    tensors = [t.data for t in list(module.parameters()) + list(module.buffers())]
    for bucket in grads._buckets(tensors):
        flat = _flatten_dense_tensors(bucket).to(device)
        dist.broadcast(flat, src=0)
        for t, synced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
            t.copy_(synced)


def _plan_blocks(module, plan):
    """The block list(s) a plan names, if one does and can be staged (else activation checkpointing
    without a pipeline looks for every list of same-class blocks)."""
    try:
        return planner.blocks_path(module, plan)
    except ValueError:  # a family the plan marks as not staged
        return None


def _set_metric_groups(module, dp_group) -> None:
    """torchmetrics sync over data-parallel replicas only: tp and pp ranks of one replica hold the same samples."""
    try:
        from torchmetrics import Metric
    except ImportError:  # pragma: no cover
        return
    for m in module.modules():
        if isinstance(m, Metric):
            m.process_group = dp_group

