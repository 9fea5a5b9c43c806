"""Swap a model's mixture-of-experts blocks for expert-parallel ones: checks first (on every rank, before
any collective), then each block this rank runs keeps its router and its share of the experts."""

from __future__ import annotations

from torch import nn

from ..marks import set_marks
from .families import check_block, find_moe_blocks
from . import router_statistics
from .layer import expert_parallel


def check_experts(model: nn.Module, ep: int, capacity: float | None = None, declared=()) -> list:
    """The model's mixture-of-experts blocks (``declared``: a user plan's 'experts' globs), checked for ``ep``;
    a clear error where ep cannot apply."""
    blocks = find_moe_blocks(model, declared)
    if (ep > 1 or capacity is not None) and not blocks:
        what = f"ep={ep}" if ep > 1 else f"moe_capacity={capacity}"
        raise ValueError(f"MegaStrategy({what}) applies to mixture-of-experts layers, but {type(model).__name__} has "
                         f"none this project knows (Mixtral, Qwen2-MoE, OLMoE, litgpt LLaMAMoE, the example GPT's "
                         f"MoE). Leave ep=1.")
    for path, block, family in blocks:
        check_block(path, block, family, ep)
    return blocks


def apply_experts(model: nn.Module, mesh, pp: int = 1, sp: bool = False, capacity: float | None = None,
                  declared=()) -> list:
    """Replace every MoE block this rank holds (not another stage's twin) with an expert-parallel one under
    ep > 1 or sp (on sequence shards: its parameters' gradients are partial sums over tp); router
    statistics span the global batch (see :mod:`.router_statistics`). Returns the new blocks."""
    swapped = []
    sp = sp and mesh.tp > 1
    for path, block, family in find_moe_blocks(model, declared):
        if any(p.is_meta for p in block.parameters()):  # another pipeline stage's, seen through a twin
            continue
        if family.returns_logits:
            router_statistics.install(block, mesh.dp_group, pp)
        if mesh.ep == 1 and not sp and capacity is None:
            continue
        new = expert_parallel(block, family, mesh.ep_group, mesh.ep, mesh.ep_rank,
                              sp_group=mesh.tp_group if sp else None, capacity_factor=capacity)
        for p in new.experts.parameters():
            set_marks(p, expert=mesh.ep > 1)
        if sp:
            for p in new.parameters():
                set_marks(p, sp_partial=True)
        parent, _, leaf = path.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, new)
        swapped.append(new)
    return swapped
