"""Expert tensor parallelism (``etp = tp``): each of a rank's ``ModuleList`` experts split over the tp group
as Megatron splits a dense MLP, gate and up by output rows, down by input columns; the experts' outputs
are partial sums over tp, summed as they leave the block (see :class:`.layer.ExpertParallelMoE`)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from ..layers.shard import ShardSpec, shard
from ..marks import set_marks
from .grouped import math_of


class _BiasOnFirst(nn.Linear):
    """A down projection split by its input columns: its bias added on the first tp rank only (the partial
    outputs are summed over tp), its gradient summed over tp (``sp_partial``; zeros on the others, so every
    tp rank has one to sum)."""

    adds_bias: bool = True

    def forward(self, x):
        return F.linear(x, self.weight, self.bias if self.adds_bias else self.bias * 0)


def check_expert_tp(path: str, block: nn.Module, family, etp: int) -> None:
    """A clear error where ``block``'s experts cannot be split over ``etp`` ranks (before any collective)."""
    if family.fused:
        raise ValueError(f"MegaStrategy(etp={etp}): {path} ({type(block).__name__}) holds its experts as 3-D parameters "
                         f"(transformers 5.x); splitting those over tp is not built yet (docs/experts.md). Use etp=1: "
                         f"ep may span the tp ranks instead.")
    for i, expert in enumerate(block.experts):
        math, where = math_of(expert), f"{path}.experts.{i} ({type(expert).__name__})"
        if math is None:
            raise ValueError(f"MegaStrategy(etp={etp}): {where} is not an expert MLP this project can split over tp "
                             f"(known: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, litgpt LLaMAMLP, the example GPT's MLP). "
                             f"Use etp=1.")
        for name in (math.gate, math.up, math.down):
            layer = getattr(expert, name) if name else None
            if layer is not None and type(layer) is not nn.Linear:
                raise ValueError(f"MegaStrategy(etp={etp}): {where}.{name} is a {type(layer).__name__}, not an nn.Linear; "
                                 f"use etp=1.")
        width = getattr(expert, math.up).out_features
        if width % etp:
            raise ValueError(f"MegaStrategy(etp={etp}): {where}.{math.up} has {width} output features, not divisible "
                             f"by etp={etp}; choose an etp that divides it, or etp=1.")
        dropout = getattr(expert, math.dropout, None) if math.dropout else None
        if dropout is not None and dropout.p > 0:
            raise ValueError(f"MegaStrategy(etp={etp}): {where}.{math.dropout} drops p={dropout.p} of each partial "
                             f"sum; set its dropout to 0, or etp=1.")


def shard_experts(experts, etp: int, rank: int) -> None:
    """Keep tp rank ``rank``'s slice of each expert in ``experts`` (in place: parameter names stay)."""
    for expert in experts:
        math = math_of(expert)
        for name in (math.gate, math.up):
            if name is not None:
                _split(getattr(expert, name), 0, etp, rank)
        down = getattr(expert, math.down)
        _split(down, 1, etp, rank)
        if down.bias is not None:
            down.__class__ = _BiasOnFirst
            down.adds_bias = rank == 0
            set_marks(down.bias, sp_partial=True)


def _split(linear: nn.Linear, dim: int, world: int, rank: int) -> None:
    """``linear``'s weight (and, along its output, bias) cut along ``dim`` into ``world`` slices; slice ``rank`` kept."""
    spec = ShardSpec(dim=dim, world=world, full=linear.weight.shape[dim])
    linear.weight = _param(linear.weight, spec, rank)
    if dim == 0 and linear.bias is not None:
        linear.bias = _param(linear.bias, ShardSpec(dim=0, world=world, full=linear.bias.shape[0]), rank)
    linear.in_features, linear.out_features = linear.weight.shape[1], linear.weight.shape[0]


def _param(p: nn.Parameter, spec: ShardSpec, rank: int) -> nn.Parameter:
    new = nn.Parameter(shard(p.detach(), spec, rank), requires_grad=p.requires_grad)
    if hasattr(p, "_lightning_tp"):
        new._lightning_tp = p._lightning_tp
    return set_marks(new, tp_spec=spec)
