"""resolve_layout: what a ParallelConfig means for one module on one pipeline rank, found and checked with
no collective and no change to the module; every refusal of a bad layout is raised here, on every rank alike.
parallelize then carries it out step by step. See docs/design/strategy.md."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from torch import nn

from .config import ModelChoices, ParallelConfig
from .context.model_checks import check_model
from .experts.router_losses import carry as router_carry
from .experts.apply import check_experts
from .pipeline.cut.block_lists import PIECEWISE
from .pipeline.cut.split import plan_stages
from .plans import checks, lookup
from .plans.sizes import head_replicas
from .recompute import full as recompute, selective


@dataclass
class Layout:
    """One module's layout: plan matches, stages, recomputation, experts, and what a full checkpoint holds."""

    matches: list
    expert_styles: list  # a user plan's 'experts' layers
    stages: Optional[object]  # pipeline.cut.split's StageLayout (None without microbatching)
    carried: Optional[object]  # router logits carried between stages (a load-balancing loss under pp)
    hf_checkpointing: list  # Hugging Face modules whose own checkpointing the stages take over
    choices: ModelChoices
    recomputed: list  # (list path, index) of blocks recomputed whole
    core: tuple  # what selective recomputation recomputes in each block
    selected: list  # (list path, index) of blocks whose core is recomputed
    full_keys: list  # the whole module's state_dict keys, before any cut
    places: Optional[list] = None  # (list path, index) of this rank's blocks (random streams, zero=3's units)


def resolve_layout(config: ParallelConfig, module: nn.Module, pp_rank: int, nccl: bool = False) -> Layout:
    """Every check of ``config`` against ``module``; raises ValueError naming the module, the size and what
    to set. ``nccl``: the transfers run on NCCL (what its p2p cannot do is refused)."""
    check_p2p(config, nccl)
    if config.cp > 1:
        check_model(module, config.cp)
    matches = checks.resolve(module, config.tp, config.sp, config.plan) if config.tp > 1 else []
    declared = lookup.expert_styles(config.plan)
    if config.ep > 1 or config.etp > 1 or config.moe_capacity is not None:
        check_experts(module, config.ep, config.moe_capacity, declared, config.etp)
    stages = stage_layout(config, module)
    carried = router_carry.carried_logits(module, stages, declared) if config.pp > 1 else None
    if config.pp > 1 and stages.decoder_start is not None:
        _check_chained_blocks(module, stages)
    hf_modules = recompute.hf_checkpointing_modules(module, stages) if config.pp > 1 else []
    choices = config.for_model(bool(hf_modules), bool(stages is not None and stages.lists))
    blocks = config.pipeline_blocks or plan_blocks(module, config.plan)
    # every stage's blocks are checked on every rank (a refusal on one stage alone would leave the others waiting)
    recomputed = _every_stage(config.pp, pp_rank, lambda r: recompute.targets(module, choices.recompute, stages, r,
                                                                             blocks)) if choices.recompute else []
    core = lookup.core_of(module, config.plan) if config.selective else ()
    selected = _every_stage(config.pp, pp_rank, lambda r: selective.places(module, stages, r, blocks, core)) \
        if config.selective else []
    if config.zero == 3 and (config.dp or 1) > 1:
        _check_zero3_shards(matches, module, config.tp)
    full_keys = list(module.state_dict().keys())
    if config.load_full is not None:  # its names only: the tensors are read after the cut, by load_full
        from .checkpoints.plain import check_full

        check_full(config.load_full, full_keys)
    places = block_places(config, module, stages, pp_rank) if config.tp > 1 or config.pp > 1 or config.zero == 3 \
        else None
    return Layout(matches, declared, stages, carried, hf_modules, choices, recomputed, core, selected, full_keys, places)


def block_places(config: ParallelConfig, module, stages, pp_rank: int) -> Optional[list]:
    """(list path, index) of the blocks rank ``pp_rank`` runs: its stages', or every block of the lists the plan
    (or ``pipeline_blocks``) names; None when the model has no block list (only without a pipeline)."""
    try:
        return recompute.block_places(module, stages, pp_rank, config.pipeline_blocks or plan_blocks(module, config.plan))
    except ValueError:
        return None


def _every_stage(pp: int, pp_rank: int, find):
    """``find(rank)`` for every pipeline rank (each may refuse), returning this rank's."""
    found = [find(r) for r in range(pp)]
    return found[pp_rank]


def check_p2p(config: ParallelConfig, nccl: bool) -> None:
    """Pipelines on NCCL: what its P2P semantics cannot run yet is refused now, not hung on later."""
    if nccl and config.pipelined and config.p2p == "eager":
        raise ValueError("MegaStrategy(p2p='eager') posts receives ahead, which NCCL queues in front of later "
                         "sends on the same stream (a deadlock); use p2p='auto' or 'batched' on GPUs.")


def stage_layout(config: ParallelConfig, module):
    """The stages ``config`` cuts ``module`` into (one stage for microbatching alone), or None without a pipeline."""
    if config.pp > 1:
        blocks = config.pipeline_blocks or lookup.blocks_path(module, config.plan)
        return plan_stages(module, config.pp, config.virtual_stages, blocks, config.stage_layers,
                           interleaved=config.schedule == "interleaved_1f1b")
    if config.pipelined:  # microbatching without stages: one stage holding every block
        return plan_stages(module, 1, 1, config.pipeline_blocks or lookup.blocks_path(module, config.plan))
    return None


def plan_blocks(module, plan):
    """The block list(s) a plan names, if one does and can be staged (else activation checkpointing
    without a pipeline looks for every list of same-class blocks)."""
    try:
        return lookup.blocks_path(module, plan)
    except ValueError:  # a family the plan marks as not staged
        return None


def _check_chained_blocks(module, stages) -> None:
    """An encoder-decoder pipeline calls each block as a whole: one called piece by piece is refused."""
    blocks = stages.blocks(module)
    for i in range(len(blocks)):
        if isinstance(blocks[i], PIECEWISE):
            raise ValueError(f"pipeline: {blocks.name(i)} is an {type(blocks[i]).__name__} whose pieces your code "
                             f"calls one by one; an encoder-decoder pipeline needs blocks called as a whole. "
                             f"Use tp/dp for this model.")


def _check_zero3_shards(matches: list, module, tp: int) -> None:
    """zero=3 cannot shard key/value heads copied to several tp ranks (their gradients are summed per head)."""
    for m in matches:
        for path, style, options in m.entries:
            if style in ("colwise", "colwise_local") and head_replicas(module.get_submodule(path), options, tp):
                raise ValueError(f"MegaStrategy(zero=3): {path} holds key/value heads copied to several tp ranks "
                                 f"(tp={tp} exceeds its heads); their gradients are summed per head, which FSDP2's "
                                 f"sharding does not allow. Use zero=1, or tp at most the number of key/value heads.")
