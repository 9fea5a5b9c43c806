"""Expert tensor parallelism (``etp``): each of a rank's experts split over etp tp ranks as Megatron splits
a dense MLP, gate and up by output rows, down by input columns (``ModuleList`` experts here, 5.x ones in
:mod:`.fused`); their outputs are partial sums over tp, summed as they leave the block."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from .. import comm
from ..layers.shard import ShardSpec, shard
from ..marks import set_marks
from .blocks.grouped import math_of


@contextlib.contextmanager
def bias_on_first(biases, etp):
    """Under etp a down projection's bias (``biases``: (module, parameter name) pairs) is added on the first tp
    rank only, the outputs being partial sums: elsewhere the experts' math reads zeros in its place for the
    call, so every tp rank has a gradient (zeros) to sum over tp (``sp_partial``)."""
    if etp is None or comm.group_rank(etp) == 0:
        yield
        return
    held = [(m, name, m._parameters[name]) for m, name in biases if m._parameters.get(name) is not None]
    for m, name, p in held:
        m._parameters[name] = p * 0
    try:
        yield
    finally:
        for m, name, p in held:
            m._parameters[name] = p


def down_biases(experts) -> list:
    """(down projection, "bias") of each ``ModuleList`` expert of a known class (see :func:`bias_on_first`)."""
    return [(getattr(e, math.down), "bias") for e in experts if (math := math_of(e)) is not None]


def enter(x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, fold=None, etp=None, sp: bool = False) -> tuple:
    """The tokens (rows, router weights, expert ids) a rank dispatches: its share of the ``fold`` ranks' alike
    ones (ep over tp), then under ``etp`` the same on each of the etp ranks (sequence shards gathered)."""
    x, weights, idx = comm.scatter_to_rows(x, fold), comm.scatter_to_rows(weights, fold), comm.split_rows(idx, fold)
    if etp is None:
        return x, weights, idx
    if sp:
        return comm.gather_from_sp(x, etp, 0), comm.gather_from_sp(weights, etp, 0), comm.all_gather(idx, 0, etp)
    return comm.copy_to_tp(x, etp), comm.copy_to_tp(weights, etp), idx


def leave(y: torch.Tensor, total: int, fold=None, etp=None, sp: bool = False) -> torch.Tensor:
    """This rank's tokens' outputs: the etp partial sums summed over the etp ranks, then gathered from the
    ``fold`` ranks (``total``: the rows before :func:`enter`'s share)."""
    if etp is not None:
        y = comm.reduce_scatter_to_sp(y, etp, 0) if sp else comm.reduce_from_tp(y, etp)
    return comm.gather_from_rows(y, total, fold)


def fused_widths(experts: nn.Module) -> dict:
    """A transformers 5.x experts module's parameters: name -> (dimension of the expert's width, equal blocks
    along it: 2 for a concatenated [gate; up]); None for the down projection's bias (whole, first tp rank)."""
    t, blocks = experts.is_transposed, 2 if getattr(experts, "is_concatenated", True) else 1
    if getattr(experts, "has_gate", True):
        widths = {"gate_up_proj": (2 if t else 1, blocks), "gate_up_proj_bias": (1, blocks)}
    else:
        widths = {"up_proj": (2 if t else 1, 1), "up_proj_bias": (1, 1)}
    return dict(widths, down_proj=(1 if t else 2, 1), down_proj_bias=None)


def check_expert_tp(path: str, block: nn.Module, family, etp: int) -> None:
    """A clear error where ``block``'s experts cannot be split over ``etp`` ranks (before any collective)."""
    if family.fused:
        return _check_fused(path, block.experts, etp)
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


def _check_fused(path: str, experts: nn.Module, etp: int) -> None:
    where = f"{path}.experts ({type(experts).__name__})"
    if getattr(experts, "has_post_expert_norm", False):
        raise ValueError(f"MegaStrategy(etp={etp}): {where} normalizes each expert's output, which a split over tp "
                         f"leaves as partial sums; use etp=1.")
    widths = fused_widths(experts)
    for name, p in experts.named_parameters(recurse=False):
        if name not in widths:
            raise ValueError(f"MegaStrategy(etp={etp}): {where}.{name} is not a parameter this project knows how to "
                             f"split over tp ({', '.join(widths)}); use etp=1.")
        if widths[name] is not None:
            dim, blocks = widths[name]
            if p.shape[dim] % (blocks * etp):
                raise ValueError(f"MegaStrategy(etp={etp}): {where}.{name} has {p.shape[dim] // blocks} features per "
                                 f"expert, not divisible by etp={etp}; choose an etp that divides it, or etp=1.")


def shard_experts(experts, etp: int, rank: int) -> None:
    """Keep slice ``rank`` (of ``etp``) of each expert in ``experts`` (in place: parameter names stay)."""
    for expert in experts:
        math = math_of(expert)
        for name in (math.gate, math.up):
            if name is not None:
                _split(getattr(expert, name), 0, etp, rank)
        down = getattr(expert, math.down)
        _split(down, 1, etp, rank)
        if down.bias is not None:  # whole on each tp rank, added on the first (see bias_on_first)
            set_marks(down.bias, sp_partial=True)


def _split(linear: nn.Linear, dim: int, world: int, rank: int) -> None:
    """``linear``'s weight (and, along its output, bias) cut along ``dim`` into ``world`` slices; slice ``rank`` kept
    (named in the spec: under an etp below tp, tp ranks etp apart hold the same slice)."""
    spec = ShardSpec(dim=dim, world=world, full=linear.weight.shape[dim], at_rank=rank)
    linear.weight = _param(linear.weight, spec, rank)
    if dim == 0 and linear.bias is not None:
        linear.bias = _param(linear.bias, ShardSpec(dim=0, world=world, full=linear.bias.shape[0], at_rank=rank), rank)
    linear.in_features, linear.out_features = linear.weight.shape[1], linear.weight.shape[0]


def _param(p: nn.Parameter, spec: ShardSpec, rank: int) -> nn.Parameter:
    new = nn.Parameter(shard(p.detach(), spec, rank), requires_grad=p.requires_grad)
    if hasattr(p, "_lightning_tp"):
        new._lightning_tp = p._lightning_tp
    return set_marks(new, tp_spec=spec)
