"""Scaled, masked (causal and/or boolean key mask) softmax over the last dim of attention scores
``(..., Tq, Tk)``, in one pass. See docs/design/kernels.md."""

from __future__ import annotations

from typing import Optional

import torch

from ._utils import block_size, num_warps, tl, triton, use_triton

#: Longest key length held in one block; longer rows use the torch path (with a warning).
MAX_COLS = 32768


@triton.jit
def _softmax_fwd(X, Y, KeyMask, x_stride, y_stride, N, Tq, rows_per_batch, causal_shift, scale,
                 CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    keep = cols < N
    if CAUSAL:
        keep = keep & (cols <= (row % Tq) + causal_shift)
    if HAS_MASK:
        km = tl.load(KeyMask + (row // rows_per_batch) * N + cols, mask=cols < N, other=0)
        keep = keep & (km != 0)
    x = tl.load(X + row * x_stride + cols, mask=keep, other=0.0).to(tl.float32)
    x = tl.where(keep, x * scale, float("-inf"))
    m = tl.max(x, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)  # fully masked row: avoid (-inf) - (-inf)
    e = tl.exp(x - m)
    s = tl.sum(e, axis=0)
    y = e / tl.where(s == 0.0, 1.0, s)
    tl.store(Y + row * y_stride + cols, y.to(Y.dtype.element_ty), mask=cols < N)


@triton.jit
def _softmax_bwd(Y, DY, DX, y_stride, dy_stride, dx_stride, N, scale, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    y = tl.load(Y + row * y_stride + cols, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + row * dy_stride + cols, mask=mask, other=0.0).to(tl.float32)
    dx = scale * y * (dy - tl.sum(y * dy, axis=0))
    tl.store(DX + row * dx_stride + cols, dx.to(DX.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


class SoftmaxFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale, causal, key_mask):
        Tq, N = x.shape[-2], x.shape[-1]
        x2 = _rows(x)
        M = x2.shape[0]
        y = torch.empty((M, N), device=x.device, dtype=x.dtype)
        has_mask = key_mask is not None
        km = key_mask.to(torch.int8).contiguous() if has_mask else x2
        rows_per_batch = M // max(x.shape[0], 1) if has_mask else 1
        BLOCK = block_size(N)
        if M > 0:
            _softmax_fwd[(M,)](x2, y, km, x2.stride(0), y.stride(0), N, Tq, rows_per_batch, N - Tq, scale,
                               CAUSAL=causal, HAS_MASK=has_mask, BLOCK=BLOCK, num_warps=num_warps(BLOCK))
        ctx.save_for_backward(y)
        ctx.scale, ctx.shape = scale, x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        M, N = y.shape
        dy2 = _rows(dy)
        dx = torch.empty_like(y)
        BLOCK = block_size(N)
        if M > 0:
            _softmax_bwd[(M,)](y, dy2, dx, y.stride(0), dy2.stride(0), dx.stride(0), N, ctx.scale, BLOCK=BLOCK,
                               num_warps=num_warps(BLOCK))
        return dx.view(ctx.shape), None, None, None


def _keep_mask(x: torch.Tensor, causal: bool, key_mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Boolean keep-mask broadcastable to ``x`` (None when nothing is masked)."""
    Tq, Tk = x.shape[-2], x.shape[-1]
    keep = None
    if causal:
        keep = torch.ones(Tq, Tk, dtype=torch.bool, device=x.device).tril(Tk - Tq)
    if key_mask is not None:
        km = key_mask.bool().view(key_mask.shape[0], *([1] * (x.dim() - 2)), Tk)
        keep = km if keep is None else keep & km
    return keep


def _softmax_torch(x, scale, causal, key_mask):
    xf = x.float() * scale
    keep = _keep_mask(x, causal, key_mask)
    if keep is not None:
        xf = xf.masked_fill(~keep, float("-inf"))
    m = xf.detach().amax(-1, keepdim=True)
    m = m.masked_fill(m == float("-inf"), 0.0)
    e = torch.exp(xf - m)
    s = e.sum(-1, keepdim=True)
    return (e / torch.where(s == 0, torch.ones_like(s), s)).to(x.dtype)


def fused_softmax(scores: torch.Tensor, scale: float = 1.0, causal: bool = False,
                  key_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``softmax(scale * scores)`` with optional causal and boolean key (padding) masks; see docs/design/kernels.md."""
    if scores.dim() < 2:
        raise ValueError("fused_softmax expects scores of shape (..., Tq, Tk)")
    if key_mask is not None:
        if scores.dim() < 3 or key_mask.shape != (scores.shape[0], scores.shape[-1]):
            raise ValueError(f"key_mask must be (B, Tk) = ({scores.shape[0]}, {scores.shape[-1]}), got "
                             f"{tuple(key_mask.shape)}")
        if key_mask.dtype != torch.bool:
            raise TypeError("key_mask must be boolean (True = keep); add float masks to the scores instead")
    if use_triton("softmax", scores, max_cols=MAX_COLS, cols=scores.shape[-1]):
        return SoftmaxFunction.apply(scores, float(scale), bool(causal), key_mask)
    return _softmax_torch(scores, scale, causal, key_mask)
