"""A rank's ``ModuleList`` experts run as one grouped GEMM per projection (``torch._grouped_mm`` over the
experts' stacked weights) where each is a known MLP of plain ``nn.Linear`` layers; ``None`` where not
(the caller loops over the experts). See docs/experts.md."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ExpertMath:
    """One expert class: ``down(act(gate(x)) * up(x))``, or ``down(act(up(x)))`` where ``gate`` is None."""

    gate: str | None
    up: str
    down: str
    act: Callable[[nn.Module], Callable]
    dropout: str | None = None  # a Dropout after ``down``: grouped only while it drops nothing


_HF_GLU = ExpertMath("gate_proj", "up_proj", "down_proj", lambda m: m.act_fn)
MATH = {
    "MixtralBlockSparseTop2MLP": ExpertMath("w1", "w3", "w2", lambda m: m.act_fn),
    "Qwen2MoeMLP": _HF_GLU, "Qwen3MoeMLP": _HF_GLU, "OlmoeMLP": _HF_GLU,
    "LLaMAMLP": ExpertMath("fc_1", "fc_2", "proj", lambda m: F.silu),
    "examples.gpt.model.MLP": ExpertMath(None, "c_fc", "c_proj", lambda m: m.act, dropout="dropout"),
}


def math_of(expert: nn.Module) -> ExpertMath | None:
    kind = type(expert)
    return MATH.get(f"{kind.__module__}.{kind.__qualname__}") or MATH.get(kind.__name__)


class _ContiguousGrad(torch.autograd.Function):
    """Identity; backward: the gradient made contiguous (``_grouped_mm``'s backward refuses a stride-0 one)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def _plain(m: nn.Module) -> bool:
    return not (m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks)


def _aligned(x: torch.Tensor, linears) -> bool:
    """``_grouped_mm`` wants 16-byte strides: every width a multiple of 16 bytes; on CUDA, bf16 only."""
    size = x.element_size()
    widths = {x.shape[-1]} | {n for lin in linears for n in (lin.in_features, lin.out_features)}
    return all(w * size % 16 == 0 for w in widths) and (x.device.type == "cpu" or x.dtype == torch.bfloat16)


def runs_grouped(rows: torch.Tensor) -> bool:
    """Grouped on CUDA (one kernel for every expert, not one launch each); on CPU the loop, where torch's
    grouped GEMM measured 1-20% slower for a step's forward and backward (docs/experts.md)."""
    return rows.device.type == "cuda"


def grouped_forward(experts: list, rows: torch.Tensor, counts: list):
    """``experts``' outputs on ``rows`` (``counts[i]`` consecutive rows for expert i) by grouped GEMMs, or
    None where they cannot be grouped (unknown or mixed classes, swapped layers, hooks, odd widths)."""
    math = math_of(experts[0]) if experts else None
    if math is None or any(type(e) is not type(experts[0]) for e in experts):
        return None
    names = [n for n in (math.gate, math.up, math.down) if n is not None]
    layers = [[getattr(e, n) for e in experts] for n in names]
    if any(type(lin) is not nn.Linear or not _plain(lin) for group in layers for lin in group):
        return None
    if any(not _plain(e) for e in experts):
        return None
    if math.dropout is not None and any(getattr(e, math.dropout).p > 0 and e.training for e in experts):
        return None
    dtype = torch.get_autocast_dtype(rows.device.type) if torch.is_autocast_enabled(rows.device.type) else rows.dtype
    x = rows.to(dtype)
    if not _aligned(x, [group[0] for group in layers]):
        return None
    offs = torch.tensor(counts, device=rows.device).cumsum(0).to(torch.int32)
    sizes = torch.tensor(counts, device=rows.device)
    project = dict(zip(names, (_project(group, offs, sizes, dtype) for group in layers)))
    act = math.act(experts[0])
    hidden = act(project[math.up](x)) if math.gate is None else act(project[math.gate](x)) * project[math.up](x)
    return project[math.down](hidden)


def _project(linears: list, offs: torch.Tensor, sizes: torch.Tensor, dtype) -> Callable:
    weight = torch.stack([lin.weight for lin in linears]).to(dtype)  # [E, out, in]
    bias = None if linears[0].bias is None else torch.stack([lin.bias for lin in linears]).to(dtype)

    def apply(x: torch.Tensor) -> torch.Tensor:
        y = _ContiguousGrad.apply(torch._grouped_mm(x.contiguous(), weight.transpose(-2, -1), offs=offs))
        return y if bias is None else y + torch.repeat_interleave(bias, sizes, dim=0)
    return apply
