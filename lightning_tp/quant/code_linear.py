"""The QAT matmul, run on the integer codes so that a tensor-parallel layer equals one device's.

A fake-quantized ``x_fq @ w_fq.T`` is a sum of rounded float products, whose value depends on the
order of summation: a row-parallel layer adds per-shard partial sums, one device adds in another
order, and the ~1e-7 difference is enough to push an activation across a rounding boundary of the
*next* quantizer (then the runs drift apart by whole grid steps). Here the matmul multiplies the
codes instead (``round(x_fq / s_x)``, ``round(w_fq / s_w)``: small integers, exact in any float
type with an 8-bit mantissa or more) and scales afterwards. Integer sums are exact in fp32 while
below 2**24, i.e. for an int8 layer up to 1040 input features (w4a8: 18 000), whatever the order:
row-parallel layers reduce these exact sums over tp and only then multiply by ``s_x * s_w``, which
is also what the converted int8 layers do, so QAT, its tp twin and int8 inference agree exactly.
Larger layers round as any fp32 matmul does.

The backward is a plain linear backward on the fake-quantized operands (the straight-through
estimators sit in the fake-quant ops before it).
"""

from __future__ import annotations

import torch


class CodeLinear(torch.autograd.Function):
    """``acc = codes(x_fq) @ codes(w_fq).T`` in fp32, autocast off (no bias, no scale); ``scale = s_x * s_w``.

    The caller reduces ``acc`` over tp if the layer is row-parallel, then multiplies by ``scale``;
    the incoming gradient is therefore ``g_y * scale``, which the backward divides out again."""

    @staticmethod
    def forward(ctx, x_fq, w_fq, s_x, s_w):
        ctx.save_for_backward(x_fq, w_fq, s_x * s_w)
        with torch.autocast(device_type=x_fq.device.type, enabled=False):  # bf16 would round the sums
            qx = torch.round(x_fq.float() * (1.0 / s_x))
            qw = torch.round(w_fq.float() * (1.0 / s_w)[:, None])
            return torch.nn.functional.linear(qx, qw)

    @staticmethod
    def backward(ctx, g_acc):
        x_fq, w_fq, scale = ctx.saved_tensors
        g = (g_acc.float() / scale).to(x_fq.dtype)  # d y / d out, as a plain linear receives it
        g_x = g @ w_fq.to(g.dtype) if ctx.needs_input_grad[0] else None
        g_w = None
        if ctx.needs_input_grad[1]:
            g_w = (g.reshape(-1, g.shape[-1]).t() @ x_fq.reshape(-1, x_fq.shape[-1])).to(w_fq.dtype)
        return g_x, g_w, None, None


def code_linear(x_fq, s_x, w_fq, s_w):
    """``(acc, scale)``: the caller returns ``acc * scale`` (+ bias), reducing ``acc`` first if needed."""
    return CodeLinear.apply(x_fq, w_fq, s_x, s_w), s_x * s_w
