"""The QAT matmul, run on the integer codes so that a tensor-parallel layer equals one device's.
See docs/design/quant.md."""

from __future__ import annotations

import torch

from ..pipeline.run.backward_phase import halves


class CodeLinear(torch.autograd.Function):
    """``acc = codes(x_fq) @ codes(w_fq).T`` in fp32, autocast off (no bias, no scale); ``scale = s_x * s_w``.
    The caller reduces ``acc`` over tp (row-parallel), then multiplies by ``scale``. See docs/design/quant.md."""

    splits_backward = True  # each half of a split backward does its own work (see backward_phase.halves)

    @staticmethod
    def forward(ctx, x_fq, w_fq, s_x, s_w):
        ctx.save_for_backward(x_fq, w_fq, s_x * s_w)
        with torch.autocast(device_type=x_fq.device.type, enabled=False):  # bf16 would round the sums
            qx = torch.round(x_fq.float() * (1.0 / s_x))
            qw = torch.round(w_fq.float() * (1.0 / s_w)[:, None])
            return torch.nn.functional.linear(qx, qw)

    @staticmethod
    def backward(ctx, g_acc):
        return halves(ctx, lambda wanted: CodeLinear._grads(ctx, g_acc, wanted), 4, (1,), joint=False)

    @staticmethod
    def _grads(ctx, g_acc, wanted):
        x_fq, w_fq, scale = ctx.saved_tensors
        g = (g_acc.float() / scale).to(x_fq.dtype)  # d y / d out, as a plain linear receives it
        g_x = g @ w_fq.to(g.dtype) if ctx.needs_input_grad[0] and 0 in wanted else None
        g_w = None
        if ctx.needs_input_grad[1] and 1 in wanted:
            g_w = (g.reshape(-1, g.shape[-1]).t() @ x_fq.reshape(-1, x_fq.shape[-1])).to(w_fq.dtype)
        return g_x, g_w, None, None


def code_linear(x_fq, s_x, w_fq, s_w):
    """``(acc, scale)``: the caller returns ``acc * scale`` (+ bias), reducing ``acc`` first if needed."""
    return CodeLinear.apply(x_fq, w_fq, s_x, s_w), s_x * s_w
