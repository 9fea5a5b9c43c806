"""QAT linear layers: plain, column-parallel and row-parallel, with results equal to one device's.
See docs/design/quant.md."""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from ..layers.linear import ColumnParallelLinear, RowParallelLinear, TPContext
from .code_linear import code_linear
from .fake_quant import ActQuantizer, fake_quant_weight_with_scale


class _QATMixin:
    """Shared bits: bit widths, the activation quantizer, the observe-only switch."""

    def _init_quant(self, w_bits: int, a_bits: int, range_mode: str, **act_kw) -> None:
        self.w_bits, self.a_bits = w_bits, a_bits
        self.act_quant = ActQuantizer(a_bits, range_mode, **act_kw)

    def _weight_group(self):
        return None

    def quant_weight(self):
        """``(fake-quantized weight, per-row scale)``, or ``(weight, None)`` while calibrating (PTQ
        observes fp32)."""
        if self.act_quant.observing:
            return self.weight, None
        return fake_quant_weight_with_scale(self.weight, self.w_bits, self._weight_group())

    def quant_matmul(self, x, reduce=None):
        """``x @ W.T`` on fake-quantized operands, computed on their codes; ``reduce`` (the tp
        reduction of a row-parallel layer) is applied to the exact integer sums, before scaling."""
        xq, s_x = self.act_quant.quantize_with_scale(x, self.weight)
        wq, s_w = self.quant_weight()
        if s_x is None or s_w is None:  # observing, or a delayed range not set yet: plain float matmul
            y = F.linear(xq, wq)
            return reduce(y) if reduce is not None else y
        acc, scale = code_linear(xq, s_x, wq, s_w)
        if reduce is not None:
            acc = reduce(acc)
        return (acc * scale).to(xq.dtype)

    def quant_linear(self, x):
        y = self.quant_matmul(x)
        return y + self.bias if self.bias is not None else y

    def quant_extra_repr(self) -> str:
        return f"w{self.w_bits}a{self.a_bits}"


class QATLinear(_QATMixin, nn.Module):
    """``nn.Linear`` with fake-quantized weight (per row) and input (per tensor). ``tp_group``: for a layer
    that may see sequence-sharded inputs (absmax MAX all-reduced over tp). See docs/design/quant.md."""

    def __init__(self, weight, bias, w_bits=8, a_bits=8, range_mode="ema", tp_group=None, dp_group=None,
                 momentum=0.95):
        super().__init__()
        self.weight, self.bias = weight, bias
        self.out_features, self.in_features = weight.shape
        ctx = TPContext(group=tp_group) if tp_group is not None else None
        self._init_quant(w_bits, a_bits, range_mode, momentum=momentum, tp_ctx=ctx, sharded=ctx is not None,
                         dp_group=dp_group)

    @classmethod
    def from_linear(cls, linear: nn.Linear, w_bits=8, a_bits=8, range_mode="ema", **kw) -> "QATLinear":
        return cls(linear.weight, linear.bias, w_bits, a_bits, range_mode, **kw)

    def forward(self, x):
        return self.quant_linear(x)

    def extra_repr(self):
        return f"in={self.in_features}, out={self.out_features}, {self.quant_extra_repr()}"


class QATColumnParallelLinear(_QATMixin, ColumnParallelLinear):
    """Column-parallel QAT: quantize the input after the region entry (replicated / SP-gathered)."""

    @classmethod
    def from_linear(cls, linear, ctx, name, memo, *, w_bits=8, a_bits=8, range_mode="ema", dp_group=None,
                    momentum=0.95, **kw) -> "QATColumnParallelLinear":
        """Shard an ``nn.Linear`` (as ``ColumnParallelLinear.from_linear``, same ``**kw``) and add QAT."""
        return cls.from_parallel(ColumnParallelLinear.from_linear(linear, ctx, name, memo, **kw), w_bits, a_bits,
                                 range_mode, dp_group, momentum)

    @classmethod
    def from_parallel(cls, layer: ColumnParallelLinear, w_bits=8, a_bits=8, range_mode="ema", dp_group=None,
                      momentum=0.95) -> "QATColumnParallelLinear":
        new = cls(layer.weight, layer.bias, layer.ctx, layer.full_out, input_comm=layer.input_comm,
                  gather_output=layer.gather_output)
        new._init_quant(w_bits, a_bits, range_mode, momentum=momentum, tp_ctx=layer.ctx, sharded=False,
                        partial_grad=layer.ctx.world > 1, dp_group=dp_group)
        return new

    def project(self, x):
        return self.quant_linear(x)

    def extra_repr(self):
        return f"{super().extra_repr()}, {self.quant_extra_repr()}"


class QATRowParallelLinear(_QATMixin, RowParallelLinear):
    """Row-parallel QAT: weight row absmax and input absmax are MAX all-reduced over tp."""

    @classmethod
    def from_linear(cls, linear, ctx, name, memo, *, w_bits=8, a_bits=8, range_mode="ema", dp_group=None,
                    momentum=0.95) -> "QATRowParallelLinear":
        """Shard an ``nn.Linear`` (as ``RowParallelLinear.from_linear``) and add QAT."""
        return cls.from_parallel(RowParallelLinear.from_linear(linear, ctx, name, memo), w_bits, a_bits, range_mode,
                                 dp_group, momentum)

    @classmethod
    def from_parallel(cls, layer: RowParallelLinear, w_bits=8, a_bits=8, range_mode="ema", dp_group=None,
                      momentum=0.95) -> "QATRowParallelLinear":
        new = cls(layer.weight, layer.bias, layer.ctx, input_is_parallel=layer.input_is_parallel)
        new._init_quant(w_bits, a_bits, range_mode, momentum=momentum, tp_ctx=layer.ctx, sharded=True,
                        partial_grad=layer.ctx.world > 1, dp_group=dp_group)
        return new

    def _weight_group(self):
        return self.ctx.group

    def project(self, x, reduce):
        return self.quant_matmul(x, reduce)

    def extra_repr(self):
        return f"{super().extra_repr()}, {self.quant_extra_repr()}"
