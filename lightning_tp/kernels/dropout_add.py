"""Fused ``residual + dropout(x + bias, p)`` with a Philox keep-mask regenerated from ``(seed, offset)``
(nothing stored for backward; the same mask on the Triton and torch paths). See docs/design/kernels.md."""

from __future__ import annotations

from typing import Optional

import torch

from ._utils import tl, triton, use_triton
from ..backward_phase import halves

BLOCK = 1024
_M32 = 0xFFFFFFFF
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57


@triton.jit
def _dropout_add_fwd(X, B, R, Y, numel, N, p, scale, seed, offset,
                     HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    z = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        z += tl.load(B + offs % N, mask=mask, other=0.0).to(tl.float32)
    keep = tl.rand(seed, offset + offs) >= p
    r = tl.load(R + offs, mask=mask, other=0.0).to(tl.float32)
    y = tl.where(keep, z * scale, 0.0) + r
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _dropout_bwd(DY, DX, numel, p, scale, seed, offset, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    keep = tl.rand(seed, offset + offs) >= p
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(DX + offs, tl.where(keep, dy * scale, 0.0).to(DX.dtype.element_ty), mask=mask)


def _mulhilo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit words of ``a * b`` for a < 2**32 and int64 ``b`` in [0, 2**32), overflow-free."""
    p_hi, p_lo = b * (a >> 16), b * (a & 0xFFFF)  # each < 2**48
    return (p_hi + (p_lo >> 16)) >> 16, (((p_hi & 0xFFFF) << 16) + p_lo) & _M32


def philox_uniform(seed: int, counters: torch.Tensor) -> torch.Tensor:
    """Bit-exact torch version of ``tl.rand(seed, counters)`` (int64 counters) -> float32 in [0, 1)."""
    counters = counters.to(torch.int64)
    c0, c1 = counters & _M32, (counters >> 32) & _M32
    c2 = c3 = torch.zeros_like(c0)
    k0, k1 = seed & _M32, (seed >> 32) & _M32
    for _ in range(10):
        hi_b, lo_b = _mulhilo(_ROUND_B, c2)
        hi_a, lo_a = _mulhilo(_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _KEY_A) & _M32, (k1 + _KEY_B) & _M32
    x = torch.where(c0 >= 2**31, c0 - 2**32, c0)  # as int32
    x = torch.where(x < 0, -x - 1, x)  # Triton maps negatives with bitwise not
    return x.to(torch.float32) * torch.tensor(4.6566127342e-10, dtype=torch.float32)


def dropout_keep_mask(seed: int, offset: int, shape, p: float, device=None) -> torch.Tensor:
    """The boolean keep-mask a call with this ``(seed, offset, shape, p)`` uses (row-major order)."""
    n = 1
    for s in shape:
        n *= int(s)
    u = philox_uniform(seed, torch.arange(offset, offset + n, dtype=torch.int64))
    return (u >= torch.tensor(p, dtype=torch.float32)).view(tuple(shape)).to(device)


class BiasDropoutAddFunction(torch.autograd.Function):
    splits_backward = True  # each half of a split backward does its own work (see backward_phase.halves)

    @staticmethod
    def forward(ctx, x, bias, residual, p, seed, offset):
        xc, rc = x.contiguous(), residual.contiguous()
        y = torch.empty_like(xc)
        scale = 0.0 if p >= 1.0 else 1.0 / (1.0 - p)
        if xc.numel():
            _dropout_add_fwd[(triton.cdiv(xc.numel(), BLOCK),)](
                xc, bias if bias is not None else xc, rc, y, xc.numel(), x.shape[-1], p, scale, seed, offset,
                HAS_BIAS=bias is not None, BLOCK=BLOCK)
        ctx.p, ctx.scale, ctx.seed, ctx.offset = p, scale, seed, offset
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return y

    @staticmethod
    def backward(ctx, dy):
        return halves(ctx, lambda wanted: BiasDropoutAddFunction._grads(ctx, dy, wanted), 6, (1,), joint=True)

    @staticmethod
    def _grads(ctx, dy, wanted):
        dy = dy.contiguous()
        dx = torch.empty_like(dy)
        if dy.numel():
            _dropout_bwd[(triton.cdiv(dy.numel(), BLOCK),)](dy, dx, dy.numel(), ctx.p, ctx.scale, ctx.seed,
                                                             ctx.offset, BLOCK=BLOCK)
        dbias = None
        if ctx.bias_dtype is not None and ctx.needs_input_grad[1]:
            dbias = dx.reshape(-1, dx.shape[-1]).float().sum(0).to(ctx.bias_dtype)
        return dx, dbias, dy, None, None, None


def bias_dropout_add(x: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor, p: float,
                     training: bool = True, seed: Optional[int] = None, offset: int = 0) -> torch.Tensor:
    """``residual + dropout(x + bias, p)`` with a ``(seed, offset)`` Philox mask; see docs/design/kernels.md.

    ``training=False`` (or ``p=0``) gives ``x + bias + residual`` (fp32 math, one cast).
    """
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability must be in [0, 1], got {p}")
    if residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    p = float(p) if training else 0.0
    if seed is None:
        seed = int(torch.randint(0, 2**31 - 1, (1,)).item())
    if use_triton("bias_dropout_add", x, bias, residual):
        return BiasDropoutAddFunction.apply(x, bias, residual, p, int(seed), int(offset))
    z = x.float() if bias is None else x.float() + bias.float()
    if p > 0.0:
        keep = dropout_keep_mask(int(seed), int(offset), x.shape, p, x.device)
        z = torch.where(keep, z * (0.0 if p >= 1.0 else 1.0 / (1.0 - p)), torch.zeros_like(z))
    return (z + residual.float()).to(x.dtype)
