"""Fused LayerNorm over the last dim: one Triton program per row forward, few programs backward.
See docs/design/kernels.md."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ._utils import autocast_input, block_size, num_programs, num_warps, tl, triton, use_triton
from ..pipeline.run.backward_phase import halves

#: Longest row kept in one block (the whole row lives in registers).
MAX_COLS = 65536


@triton.jit
def _ln_fwd(X, Y, W, B, Mean, Rstd, x_stride, y_stride, N, eps,
            HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(X + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / N
    xc = tl.where(mask, x - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / N + eps)
    y = xc * rstd * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y += tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * y_stride + cols, y.to(Y.dtype.element_ty), mask=mask)
    tl.store(Mean + row, mean)
    tl.store(Rstd + row, rstd)


@triton.jit
def _ln_bwd(X, W, DY, DX, Mean, Rstd, DW, DB, x_stride, dy_stride, dx_stride, N, n_rows, rows_per_prog,
            BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    db = tl.zeros([BLOCK], dtype=tl.float32)
    start = pid.to(tl.int64) * rows_per_prog  # int64 loop index: row * stride may pass 2**31
    end = tl.minimum(start + rows_per_prog, n_rows)
    for row in range(start, end):
        x = tl.load(X + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * dy_stride + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(Rstd + row)
        xhat = tl.where(mask, (x - tl.load(Mean + row)) * rstd, 0.0)
        wdy = w * dy
        c1 = tl.sum(xhat * wdy, axis=0) / N
        c2 = tl.sum(wdy, axis=0) / N
        dx = (wdy - (xhat * c1 + c2)) * rstd
        tl.store(DX + row * dx_stride + cols, dx.to(DX.dtype.element_ty), mask=mask)
        dw += dy * xhat
        db += dy
    tl.store(DW + pid * N + cols, dw, mask=mask)
    tl.store(DB + pid * N + cols, db, mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """(..., N) -> (rows, N) with unit column stride (copies only if it must)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


class LayerNormFunction(torch.autograd.Function):
    """Triton LayerNorm. ``weight`` may be None (ones); ``bias`` may be None."""

    splits_backward = True  # each half of a split backward does its own work (see backward_phase.halves)

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        N = x.shape[-1]
        x2 = _rows(x)
        w = weight if weight is not None else torch.ones(N, device=x.device, dtype=x.dtype)
        M = x2.shape[0]
        y = torch.empty((M, N), device=x.device, dtype=x.dtype)
        mean = torch.empty(M, device=x.device, dtype=torch.float32)
        rstd = torch.empty_like(mean)
        BLOCK = block_size(N)
        if M > 0:
            _ln_fwd[(M,)](x2, y, w, bias if bias is not None else w, mean, rstd, x2.stride(0), y.stride(0), N, eps,
                          HAS_BIAS=bias is not None, BLOCK=BLOCK, num_warps=num_warps(BLOCK))
        ctx.save_for_backward(x2, w, mean, rstd)
        ctx.meta = (x.shape, weight is not None, bias is not None, bias.dtype if bias is not None else None)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        return halves(ctx, lambda wanted: LayerNormFunction._grads(ctx, dy, wanted), 4, (1, 2), joint=True)

    @staticmethod
    def _grads(ctx, dy, wanted):
        x2, w, mean, rstd = ctx.saved_tensors
        shape, has_w, has_b, b_dtype = ctx.meta
        M, N = x2.shape
        dy2 = _rows(dy)
        dx = torch.empty_like(x2)
        P = num_programs(M, x2.device)
        dw = torch.empty((P, N), device=x2.device, dtype=torch.float32)
        db = torch.empty_like(dw)
        BLOCK = block_size(N)
        if M > 0:
            _ln_bwd[(P,)](x2, w, dy2, dx, mean, rstd, dw, db, x2.stride(0), dy2.stride(0), dx.stride(0), N, M,
                          triton.cdiv(M, P), BLOCK=BLOCK, num_warps=num_warps(BLOCK))
        else:
            dw.zero_()
            db.zero_()
        dweight = dw.sum(0).to(w.dtype) if has_w and ctx.needs_input_grad[1] else None
        dbias = db.sum(0).to(b_dtype) if has_b and ctx.needs_input_grad[2] else None
        return dx.view(shape), dweight, dbias, None


def layer_norm(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor] = None,
               eps: float = 1e-5) -> torch.Tensor:
    """LayerNorm over the last dim; Triton when available, else fp32 torch with the same numbers. Under
    autocast, in the dtype the device's autocast gives ``F.layer_norm``."""
    x = autocast_input("layer_norm", lambda t: F.layer_norm(t, (1,)), x)
    if use_triton("layer_norm", x, weight, bias, max_cols=MAX_COLS, cols=x.shape[-1]):
        return LayerNormFunction.apply(x, weight, bias, eps)
    N = x.shape[-1]
    w = weight.float() if weight is not None else None
    b = bias.float() if bias is not None else None
    return F.layer_norm(x.float(), (N,), w, b, eps).to(x.dtype)


class FusedLayerNorm(nn.LayerNorm):
    """Drop-in ``nn.LayerNorm`` (same parameter names) whose forward is :func:`layer_norm`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.normalized_shape) != 1:  # multi-dim normalized_shape: plain torch
            return super().forward(x)
        return layer_norm(x, self.weight, self.bias, self.eps)

    @classmethod
    def from_module(cls, m: nn.LayerNorm) -> "FusedLayerNorm":
        """Wrap ``m``'s own Parameter objects (no copy), so optimizers and state_dicts still match."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.normalized_shape = tuple(m.normalized_shape)
        new.eps = m.eps
        new.elementwise_affine = getattr(m, "elementwise_affine", m.weight is not None)
        new.register_parameter("weight", m.weight)
        new.register_parameter("bias", getattr(m, "bias", None))
        new.train(m.training)
        return new
