"""Swap a model's mixture-of-experts blocks for expert-parallel ones: checks first (on every rank, before
any collective), then each block this rank runs keeps its router and its share of the experts."""

from __future__ import annotations

from torch import nn

from ..marks import marks_of, set_marks
from .families import LLAMA4, SWITCH, check_block, find_moe_blocks
from .router_losses import statistics as router_statistics
from .blocks.fused import expert_parallel_experts, gather_router_logits
from .expert_tp import check_expert_tp, shard_experts
from .blocks.layer import ExpertParallelMoE, expert_parallel
from .blocks.llama4 import llama4_parallel
from .blocks.switch import switch_parallel


def check_experts(model: nn.Module, ep: int, capacity: float | None = None, declared=(), etp: int = 1) -> list:
    """The model's mixture-of-experts blocks (``declared``: a user plan's 'experts' globs), checked for ``ep``
    and ``etp``; a clear error where they cannot apply."""
    blocks = find_moe_blocks(model, declared)
    if (ep > 1 or etp > 1 or capacity is not None) and not blocks:
        what = f"ep={ep}" if ep > 1 else f"etp={etp}" if etp > 1 else f"moe_capacity={capacity}"
        unknown = [f"{path} ({type(m).__name__})" for path, m in model.named_modules() if path and _looks_like_moe(m)]
        hint = (f" These look like mixture-of-experts layers: {', '.join(unknown[:3])}"
                f"{' ...' if len(unknown) > 3 else ''}; declare them in a plan, e.g. plan={{'styles': "
                f"{{'{_glob(unknown[0].split(' ')[0])}': {{'style': 'experts', 'top_k': 2}}}}}} (docs/experts.md), "
                f"or leave ep=1." if unknown else " Leave ep=1.")
        raise ValueError(f"MegaStrategy({what}) applies to mixture-of-experts layers, but {type(model).__name__} has "
                         f"none this project knows (Hugging Face transformers 5.x experts modules, Mixtral, Qwen2-MoE, "
                         f"Qwen3-MoE, OLMoE, Llama 4, Switch Transformers, litgpt LLaMAMoE, the example GPT's MoE).{hint}")
    for path, block, family in blocks:
        check_block(path, block, family, ep)
        if family is SWITCH and (etp > 1 or capacity is not None):
            what = f"etp={etp}" if etp > 1 else f"moe_capacity={capacity}"
            raise ValueError(f"MegaStrategy({what}): {path} ({type(block).__name__}) is Switch Transformers' sparse MLP, "
                             f"whose router caps each expert itself (config.expert_capacity) and whose experts are "
                             f"not split over tp; leave {what.split('=')[0]} at its default.")
        if family is LLAMA4 and (etp > 1 or capacity is not None):
            what = f"etp={etp}" if etp > 1 else f"moe_capacity={capacity}"
            raise ValueError(f"MegaStrategy({what}): {path} ({type(block).__name__}) is Llama 4's mixture of experts, "
                             f"whose experts are not split over tp nor capped yet; leave {what.split('=')[0]} at its "
                             f"default (ep splits its experts).")
        if etp > 1:
            check_expert_tp(path, block, family, etp)
    return blocks


def _looks_like_moe(m: nn.Module) -> bool:
    """A module that holds experts (an ``experts`` child, or Moe/Experts in its class name) but no known family."""
    name = type(m).__name__.lower()
    return hasattr(m, "experts") or "moe" in name or name.endswith(("sparsemlp", "experts"))


def _glob(path: str) -> str:
    """``path`` with its layer indices as ``*`` (a plan's glob for every such layer)."""
    return ".".join("*" if part.isdigit() else part for part in path.split("."))


def apply_experts(model: nn.Module, mesh, pp: int = 1, sp: bool = False, capacity: float | None = None,
                  declared=()) -> list:
    """Replace every MoE block this rank holds (not another stage's twin) with an expert-parallel one under
    ep > 1 or sp (on sequence shards: its parameters' gradients are partial sums over tp); router
    statistics span the global batch (see :mod:`.router_losses.statistics`). Returns the new blocks."""
    swapped = []
    sp = sp and mesh.tp > 1
    fold = mesh.fold_group if mesh.ep_folds_tp and not sp else None  # tp ranks with alike tokens: each a share
    etp = mesh.etp_group if mesh.etp > 1 else None  # each expert split over etp of the tp ranks
    for path, block, family in find_moe_blocks(model, declared):
        if any(p.is_meta for p in block.parameters()):  # another pipeline stage's, seen through a twin
            continue
        if family.fused:
            swapped.append(_fused(block, mesh, pp, sp, capacity, fold, etp))
            continue
        if family is SWITCH:
            if mesh.ep > 1 or sp:
                swapped.append(_switch(model, path, block, mesh, sp))
            continue
        if family is LLAMA4:
            swapped.append(_llama4(model, path, block, mesh, sp, fold))
            continue
        if family.returns_logits:
            router_statistics.install(block, mesh.dp_group, pp)
        if mesh.ep == 1 and not sp and capacity is None and etp is None:
            continue
        new = expert_parallel(block, family, mesh.ep_group, mesh.ep, mesh.ep_rank, sp_group=mesh.tp_group if sp else None,
                              capacity_factor=capacity, fold_group=fold, etp_group=etp)
        if etp is not None:
            shard_experts(new.experts.values(), mesh.etp, mesh.tp_rank % mesh.etp)
        for p in new.experts.parameters():
            set_marks(p, expert=mesh.ep > 1)
        _mark_sp_partial(new, sp)
        model.set_submodule(path, new)
        swapped.append(new)
    return swapped


def _mark_sp_partial(block: nn.Module, sp: bool) -> None:
    """On sequence shards the block's gradients are partial sums over tp; an expert split over ep is not
    (its ep group spans the tp ranks: its gradient sums over its expert-data-parallel group)."""
    for p in block.parameters() if sp else ():
        if not marks_of(p).expert and marks_of(p).tp_spec is None:  # an expert split over tp (etp): whole grads
            set_marks(p, sp_partial=True)


def _fused(block: nn.Module, mesh, pp: int, sp: bool, capacity, fold, etp) -> nn.Module:
    """A transformers 5.x block: its router and the rest stay, its ``experts`` go expert-parallel (``etp``: each
    expert's width split over the tp ranks too); on sequence shards its gradients are partial sums over tp and
    its router logits are gathered for the loss."""
    router_statistics.install(block.experts, mesh.dp_group, pp)
    if mesh.ep > 1 or capacity is not None or etp is not None:
        expert_parallel_experts(block.experts, mesh.ep_group, mesh.ep, mesh.ep_rank, capacity, fold, etp,
                                mesh.tp_rank % mesh.etp, sp)
    _mark_sp_partial(block, sp)
    if sp:
        gather_router_logits(block, mesh.tp_group)
    return block


def _switch(model: nn.Module, path: str, block: nn.Module, mesh, sp: bool) -> nn.Module:
    """Switch Transformers' block expert-parallel; under sp its router and experts see the whole sequence (the
    tp ranks then hold the same tokens and split them, as without sp), so its gradients are whole ones."""
    fold = mesh.fold_group if mesh.ep_folds_tp else None
    new = switch_parallel(block, mesh.ep_group, mesh.ep, mesh.ep_rank, mesh.tp_group if sp else None, fold)
    for p in new.experts.parameters():
        set_marks(p, expert=mesh.ep > 1)
    model.set_submodule(path, new)
    return new


def _llama4(model: nn.Module, path: str, block: nn.Module, mesh, sp: bool, fold) -> nn.Module:
    """Llama 4's block expert-parallel under ep > 1 (else left whole); on sequence shards each rank routes its own
    tokens and the block's gradients are partial sums over tp."""
    if mesh.ep > 1:
        block = llama4_parallel(block, mesh.ep_group, mesh.ep, mesh.ep_rank, mesh.tp_group if sp else None, fold)
        model.set_submodule(path, block)
    _mark_sp_partial(block, sp)
    return block


def rebind_experts(model: nn.Module, mesh, pp: int, declared=()) -> None:
    """A module parallelized before, fitted again under a new strategy (the same layout): its expert layers and
    router statistics take the new mesh's groups."""
    like = lambda old, group: group if old is not None else None  # noqa: E731 (a group where one was)
    stats = []  # modules whose modeling module's load-balancing loss reads the dp group
    for m in model.modules():
        ep = getattr(m, "_lightning_tp_ep", None)
        if isinstance(m, ExpertParallelMoE):
            m.group, m.sp_group = mesh.ep_group, like(m.sp_group, mesh.tp_group)
            m.fold_group, m.etp_group = like(m.fold_group, mesh.fold_group), like(m.etp_group, mesh.etp_group)
            stats += [m] if m.family.returns_logits else []
        elif ep is not None:
            ep.update(group=mesh.ep_group, fold=like(ep["fold"], mesh.fold_group), etp=like(ep["etp"], mesh.etp_group))
            stats.append(m)
    for _, block, family in find_moe_blocks(model, declared):  # blocks left whole (ep=1 without sp)
        if family.fused or family.returns_logits:
            stats.append(block.experts if family.fused else block)
    for m in stats:
        source = next(c for c in type(m).__mro__ if not c.__module__.startswith(__package__))  # not our subclass
        router_statistics.install_for(source.__module__, mesh.dp_group, pp)
