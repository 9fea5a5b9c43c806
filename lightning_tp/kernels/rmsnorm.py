"""Fused RMSNorm over the last dim (Llama/T5 style: no mean subtraction, no bias).
See docs/design/kernels.md."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ._utils import autocast_input, block_size, num_programs, num_warps, tl, triton, use_triton
from ..pipeline.run.backward_phase import halves

MAX_COLS = 65536


@triton.jit
def _rms_fwd(X, Y, W, Rstd, x_stride, y_stride, N, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(X + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
    y = x * rstd * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * y_stride + cols, y.to(Y.dtype.element_ty), mask=mask)
    tl.store(Rstd + row, rstd)


@triton.jit
def _rms_bwd(X, W, DY, DX, Rstd, DW, x_stride, dy_stride, dx_stride, N, n_rows, rows_per_prog,
             BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    start = pid.to(tl.int64) * rows_per_prog
    end = tl.minimum(start + rows_per_prog, n_rows)
    for row in range(start, end):
        x = tl.load(X + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * dy_stride + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(Rstd + row)
        xhat = x * rstd
        wdy = w * dy
        dx = (wdy - xhat * (tl.sum(xhat * wdy, axis=0) / N)) * rstd
        tl.store(DX + row * dx_stride + cols, dx.to(DX.dtype.element_ty), mask=mask)
        dw += dy * xhat
    tl.store(DW + pid * N + cols, dw, mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


class RMSNormFunction(torch.autograd.Function):
    splits_backward = True  # each half of a split backward does its own work (see backward_phase.halves)

    @staticmethod
    def forward(ctx, x, weight, eps):
        N = x.shape[-1]
        x2 = _rows(x)
        M = x2.shape[0]
        y = torch.empty((M, N), device=x.device, dtype=x.dtype)
        rstd = torch.empty(M, device=x.device, dtype=torch.float32)
        BLOCK = block_size(N)
        if M > 0:
            _rms_fwd[(M,)](x2, y, weight, rstd, x2.stride(0), y.stride(0), N, eps, BLOCK=BLOCK,
                           num_warps=num_warps(BLOCK))
        ctx.save_for_backward(x2, weight, rstd)
        ctx.shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        return halves(ctx, lambda wanted: RMSNormFunction._grads(ctx, dy, wanted), 3, (1,), joint=True)

    @staticmethod
    def _grads(ctx, dy, wanted):
        x2, w, rstd = ctx.saved_tensors
        M, N = x2.shape
        dy2 = _rows(dy)
        dx = torch.empty_like(x2)
        P = num_programs(M, x2.device)
        dw = torch.zeros((P, N), device=x2.device, dtype=torch.float32)
        BLOCK = block_size(N)
        if M > 0:
            _rms_bwd[(P,)](x2, w, dy2, dx, rstd, dw, x2.stride(0), dy2.stride(0), dx.stride(0), N, M,
                           triton.cdiv(M, P), BLOCK=BLOCK, num_warps=num_warps(BLOCK))
        dweight = dw.sum(0).to(w.dtype) if ctx.needs_input_grad[1] else None
        return dx.view(ctx.shape), dweight, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: Optional[float] = 1e-6) -> torch.Tensor:
    """RMSNorm ``x * rsqrt(mean(x**2) + eps) * weight`` over the last dim.

    ``eps=None`` means ``torch.finfo(x.dtype).eps`` (the ``nn.RMSNorm`` convention).
    """
    x = autocast_input("rms_norm", lambda t: torch.rms_norm(t, (1,)), x)  # as autocast runs the eager op
    if eps is None:
        eps = torch.finfo(x.dtype).eps
    if use_triton("rms_norm", x, weight, max_cols=MAX_COLS, cols=x.shape[-1]):
        return RMSNormFunction.apply(x, weight, eps)
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


class FusedRMSNorm(nn.Module):
    """RMSNorm with a ``weight`` parameter (state_dict-compatible with ``nn.RMSNorm`` and HF RMSNorms)."""

    def __init__(self, hidden_size: int, eps: Optional[float] = 1e-6, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"

    @classmethod
    def from_module(cls, m: nn.Module) -> "FusedRMSNorm":
        """Take over ``m.weight`` (the same Parameter) and its epsilon.

        Accepts ``nn.RMSNorm`` (``eps``, possibly None) and HF-style modules (``variance_epsilon``).
        """
        weight = getattr(m, "weight", None)
        if weight is None or weight.dim() != 1:
            raise TypeError(f"{type(m).__name__} has no 1-D `weight`; cannot replace it with FusedRMSNorm")
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.register_parameter("weight", weight)
        new.eps = m.eps if hasattr(m, "eps") else getattr(m, "variance_epsilon", 1e-6)
        new.train(m.training)
        return new
