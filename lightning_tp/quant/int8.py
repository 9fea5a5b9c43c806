"""True int8 inference layers, built from trained (or calibrated) QAT layers by :func:`convert`.
See docs/design/quant.md."""

from __future__ import annotations

import torch
from torch import nn

from .. import comm
from .fake_quant import qmax_of, quantize, weight_scale
from .int8_mm import int8_linear, int8_matmul


class Int8Linear(nn.Module):
    """int8 weight + per-row scale, per-tensor activation scale; the int8 twin of ``QATLinear``."""

    backend = "auto"  # int8 GEMM backend (see int8_mm.int8_matmul); a class attribute tests may set

    def __init__(self, weight_int8, weight_scale, act_scale, bias, a_bits=8, w_bits=8):
        super().__init__()
        self.out_features, self.in_features = weight_int8.shape
        self.a_bits, self.w_bits, self.a_qmax = a_bits, w_bits, qmax_of(a_bits)
        self.register_buffer("weight_int8", weight_int8)
        self.register_buffer("weight_scale", weight_scale.float())
        self.register_buffer("act_scale", act_scale.float().reshape(()))
        self.bias = nn.Parameter(bias.detach().clone(), requires_grad=False) if bias is not None else None

    @staticmethod
    def _quant_parts(layer, group=None):
        w = layer.weight.detach()
        ws = weight_scale(w, layer.w_bits, group).float()
        wq = quantize(w.float(), ws[:, None], qmax_of(layer.w_bits)).to(torch.int8)
        return wq, ws, layer.act_quant.scale()

    @classmethod
    def from_qat(cls, layer) -> "Int8Linear":
        wq, ws, a_s = cls._quant_parts(layer)
        return cls(wq, ws, a_s, layer.bias, layer.a_bits, layer.w_bits)

    def quantize_input(self, x: torch.Tensor) -> torch.Tensor:
        """(..., K) float -> (M, K) int8 codes, with the frozen per-tensor scale."""
        return quantize(x.reshape(-1, x.shape[-1]).float(), self.act_scale, self.a_qmax).to(torch.int8)

    def _out_scale(self) -> torch.Tensor:
        return self.act_scale * self.weight_scale

    def forward(self, x):
        y = int8_linear(self.quantize_input(x), self.weight_int8, self._out_scale(), self.bias, x.dtype,
                        self.backend)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self):
        return f"in={self.in_features}, out={self.out_features}, w{self.w_bits}a{self.a_bits} int8"


class Int8ColumnParallelLinear(Int8Linear):
    """int8 twin of ``QATColumnParallelLinear``: enter the region, int8 GEMM on local rows, gather."""

    def __init__(self, weight_int8, weight_scale, act_scale, bias, a_bits, w_bits, ctx, full_out,
                 input_comm=True, gather_output=False):
        super().__init__(weight_int8, weight_scale, act_scale, bias, a_bits, w_bits)
        self.ctx, self.full_out, self.input_comm, self.gather_output = ctx, full_out, input_comm, gather_output

    @classmethod
    def from_qat(cls, layer) -> "Int8ColumnParallelLinear":
        wq, ws, a_s = cls._quant_parts(layer)
        return cls(wq, ws, a_s, layer.bias, layer.a_bits, layer.w_bits, layer.ctx, layer.full_out,
                   layer.input_comm, layer.gather_output)

    def forward(self, x):
        if self.input_comm:
            x = self.ctx.enter_region(x)
        y = super().forward(x)
        if self.gather_output is True or (self.gather_output == "eval" and not self.training):
            y = comm.gather_from_tp(y, self.ctx.group, -1)
            if y.shape[-1] != self.full_out:
                y = y[..., : self.full_out]
        return y


class Int8RowParallelLinear(Int8Linear):
    """int8 twin of ``QATRowParallelLinear``: int32 partial sums reduced over tp, then dequantized."""

    def __init__(self, weight_int8, weight_scale, act_scale, bias, a_bits, w_bits, ctx, input_is_parallel=True):
        super().__init__(weight_int8, weight_scale, act_scale, bias, a_bits, w_bits)
        self.ctx, self.input_is_parallel = ctx, input_is_parallel

    @classmethod
    def from_qat(cls, layer) -> "Int8RowParallelLinear":
        wq, ws, a_s = cls._quant_parts(layer, layer.ctx.group)  # collective: every tp rank converts
        return cls(wq, ws, a_s, layer.bias, layer.a_bits, layer.w_bits, layer.ctx, layer.input_is_parallel)

    def forward(self, x):
        if not self.input_is_parallel:
            x = comm.scatter_to_tp(x, self.ctx.group, -1)
        lead = x.shape[:-1]
        acc = int8_matmul(self.quantize_input(x), self.weight_int8, self.backend).reshape(*lead, self.out_features)
        if self.ctx.sp_now():
            acc = comm.reduce_scatter(acc, self.ctx.token_dim(acc), self.ctx.group)
        else:
            acc = comm.all_reduce(acc, self.ctx.group)
        y = acc.float() * self._out_scale()
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype)
