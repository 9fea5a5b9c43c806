"""Quantization-aware training (int8 / w4a8) for plain and tensor-parallel models: :func:`apply_qat`,
:func:`calibrate`, then :func:`convert` to int8 inference layers. See docs/design/quant.md."""

from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch
from torch import nn

from ..layers.linear import ColumnParallelLinear, RowParallelLinear
from .fake_quant import RANGE_MODES, ActQuantizer, fake_quant, fake_quant_weight, qmax_of, weight_scale
from .int8 import Int8ColumnParallelLinear, Int8Linear, Int8RowParallelLinear
from .int8_mm import int8_linear, int8_matmul
from .layers import QATColumnParallelLinear, QATLinear, QATRowParallelLinear

#: mode -> (weight bits, activation bits)
QUANT_MODES = {"int8": (8, 8), "w4a8": (4, 8)}

#: Leaf names treated as the LM head (kept in full precision unless ``skip_lm_head=False``).
LM_HEAD_NAMES = ("lm_head", "output", "embed_out")

_QAT_TYPES = (QATLinear, QATColumnParallelLinear, QATRowParallelLinear)


def bits_of(mode: str) -> tuple:
    if mode not in QUANT_MODES:
        raise ValueError(f"unknown quantization mode {mode!r}; choose one of {sorted(QUANT_MODES)}.")
    return QUANT_MODES[mode]


def _is_lm_head(name: str, module: nn.Module, embedding_weights: set) -> bool:
    if name.rpartition(".")[2] in LM_HEAD_NAMES or id(module.weight) in embedding_weights:
        return True
    return isinstance(module, ColumnParallelLinear) and module.gather_output is not False  # plan style lm_head


def apply_qat(module: nn.Module, mode: str = "int8", tp_group=None, dp_group=None, *, act_range: str = "ema",
              skip_lm_head: bool = True, skip: Iterable[str] = (), momentum: float = 0.95) -> dict:
    """Swap every ``nn.Linear`` / ``ColumnParallelLinear`` / ``RowParallelLinear`` for its QAT twin, in
    place, keeping the same Parameter objects. Returns ``{path: new module}``.
    Arguments: docs/design/quant.md."""
    w_bits, a_bits = bits_of(mode)
    if act_range not in RANGE_MODES:
        raise ValueError(f"unknown activation range mode {act_range!r}; choose one of {list(RANGE_MODES)}.")
    skip = tuple(skip)
    embedding_weights = {id(m.weight) for m in module.modules() if isinstance(m, nn.Embedding)}
    kw = dict(w_bits=w_bits, a_bits=a_bits, range_mode=act_range, dp_group=dp_group, momentum=momentum)
    replaced = {}
    for name, m in list(module.named_modules()):
        if isinstance(m, _QAT_TYPES) or any(name == s or name.startswith(s + ".") for s in skip):
            continue
        if not isinstance(m, (nn.Linear, ColumnParallelLinear, RowParallelLinear)):
            continue
        if skip_lm_head and _is_lm_head(name, m, embedding_weights):
            continue
        if name == "":
            raise ValueError("apply_qat swaps submodules in place; wrap a bare Linear in a container first.")
        if isinstance(m, ColumnParallelLinear):
            new = QATColumnParallelLinear.from_parallel(m, **kw)
        elif isinstance(m, RowParallelLinear):
            new = QATRowParallelLinear.from_parallel(m, **kw)
        else:
            new = QATLinear.from_linear(m, tp_group=tp_group, **kw)
        new.train(m.training)
        module.set_submodule(name, new)
        replaced[name] = new
    return replaced


def quantizers(module: nn.Module) -> list:
    return [m for m in module.modules() if isinstance(m, ActQuantizer)]


@torch.no_grad()
def calibrate(module: nn.Module, batches: Iterable, forward: Optional[Callable] = None) -> int:
    """PTQ: set each activation range to the mean absmax of ``forward(module, batch)`` over ``batches`` (eval,
    no parameter changes); returns the number of batches. Call it on every rank (it communicates).
    See docs/design/quant.md."""
    qs = quantizers(module)
    if not qs:
        raise ValueError("calibrate() found no QAT layers: call apply_qat(model, mode) first.")
    forward = forward or (lambda m, b: m(b[0]) if isinstance(b, (tuple, list)) else m(b))
    was_training = module.training
    module.eval()
    for q in qs:
        q.observing, q._observed = True, 0
    n = 0
    try:
        for batch in batches:
            forward(module, batch)
            n += 1
    finally:
        for q in qs:
            q.observing = False
        module.train(was_training)
    if n == 0:
        raise ValueError("calibrate() got no batches.")
    return n


@torch.no_grad()
def convert(module: nn.Module) -> dict:
    """Replace every QAT layer with its int8 inference twin, in place; returns ``{path: new}``.
    Every activation range must be set (trained or calibrated). Collective for row-parallel layers:
    call it on every tp rank."""
    replaced = {}
    for name, m in list(module.named_modules()):
        if isinstance(m, QATColumnParallelLinear):
            new = Int8ColumnParallelLinear.from_qat(m)
        elif isinstance(m, QATRowParallelLinear):
            new = Int8RowParallelLinear.from_qat(m)
        elif isinstance(m, QATLinear):
            new = Int8Linear.from_qat(m)
        else:
            continue
        new.train(m.training)
        module.set_submodule(name, new)
        replaced[name] = new
    return replaced


__all__ = [
    "QUANT_MODES", "RANGE_MODES", "apply_qat", "calibrate", "convert", "quantizers", "bits_of",
    "ActQuantizer", "QATLinear", "QATColumnParallelLinear", "QATRowParallelLinear",
    "Int8Linear", "Int8ColumnParallelLinear", "Int8RowParallelLinear",
    "fake_quant", "fake_quant_weight", "weight_scale", "qmax_of", "int8_matmul", "int8_linear",
]
