"""Fused ``gelu(x + bias)`` (tanh or exact): the MLP up-projection's bias add and activation in one
elementwise pass. See docs/design/kernels.md."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ._utils import tl, triton, use_triton
from ..pipeline.run.backward_phase import halves

BLOCK = 1024  # elements per program; constants below: sqrt(2/pi), 1/sqrt(2), 1/sqrt(2*pi), 3*0.044715


@triton.jit
def _gelu_grad_parts(z, EXACT: tl.constexpr):
    """Returns (gelu(z), d gelu / dz) in fp32."""
    if EXACT:
        cdf = 0.5 * (1.0 + tl.erf(z * 0.7071067811865476))
        y = z * cdf
        dy = cdf + z * 0.3989422804014327 * tl.exp(-0.5 * z * z)
    else:
        u = 0.7978845608028654 * (z + 0.044715 * z * z * z)
        t = 2.0 * tl.sigmoid(2.0 * u) - 1.0  # tanh(u)
        y = 0.5 * z * (1.0 + t)
        dy = 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 0.134145 * z * z)
    return y, dy


@triton.jit
def _bias_gelu_fwd(X, B, Y, numel, N, HAS_BIAS: tl.constexpr, EXACT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    z = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        z += tl.load(B + offs % N, mask=mask, other=0.0).to(tl.float32)
    y, _ = _gelu_grad_parts(z, EXACT)
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _bias_gelu_bwd(X, B, DY, DX, numel, N, HAS_BIAS: tl.constexpr, EXACT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    z = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        z += tl.load(B + offs % N, mask=mask, other=0.0).to(tl.float32)
    _, dgelu = _gelu_grad_parts(z, EXACT)
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(DX + offs, (dy * dgelu).to(DX.dtype.element_ty), mask=mask)


class BiasGeLUFunction(torch.autograd.Function):
    splits_backward = True  # each half of a split backward does its own work (see backward_phase.halves)

    @staticmethod
    def forward(ctx, x, bias, approximate):
        xc = x.contiguous()
        y = torch.empty_like(xc)
        exact = approximate == "none"
        grid = (triton.cdiv(xc.numel(), BLOCK),)
        if xc.numel():
            _bias_gelu_fwd[grid](xc, bias if bias is not None else xc, y, xc.numel(), x.shape[-1],
                                 HAS_BIAS=bias is not None, EXACT=exact, BLOCK=BLOCK)
        ctx.save_for_backward(xc, bias)
        ctx.exact = exact
        return y

    @staticmethod
    def backward(ctx, dy):
        return halves(ctx, lambda wanted: BiasGeLUFunction._grads(ctx, dy, wanted), 3, (1,), joint=True)

    @staticmethod
    def _grads(ctx, dy, wanted):
        xc, bias = ctx.saved_tensors
        dy = dy.contiguous()
        dx = torch.empty_like(xc)
        if xc.numel():
            _bias_gelu_bwd[(triton.cdiv(xc.numel(), BLOCK),)](
                xc, bias if bias is not None else xc, dy, dx, xc.numel(), xc.shape[-1],
                HAS_BIAS=bias is not None, EXACT=ctx.exact, BLOCK=BLOCK)
        dbias = None
        if bias is not None and ctx.needs_input_grad[1]:
            dbias = dx.reshape(-1, xc.shape[-1]).float().sum(0).to(bias.dtype)
        return dx, dbias, None


def bias_gelu(x: torch.Tensor, bias: Optional[torch.Tensor] = None, approximate: str = "tanh") -> torch.Tensor:
    """``gelu(x + bias)`` (bias over the last dim, optional); output in ``x.dtype``, math in fp32."""
    if approximate not in ("tanh", "none"):
        raise ValueError(f"approximate must be 'tanh' or 'none', got {approximate!r}")
    if bias is not None and bias.shape != (x.shape[-1],):
        raise ValueError(f"bias must have shape ({x.shape[-1]},), got {tuple(bias.shape)}")
    if use_triton("bias_gelu", x, bias):
        return BiasGeLUFunction.apply(x, bias, approximate)
    z = x.float() if bias is None else x.float() + bias.float()
    return F.gelu(z, approximate=approximate).to(x.dtype)


class FusedBiasGeLU(nn.Module):
    """GeLU with an optional fused ``bias`` parameter (the bias of the Linear in front of it)."""

    def __init__(self, bias_size: Optional[int] = None, approximate: str = "tanh", device=None, dtype=None):
        super().__init__()
        self.approximate = approximate
        if bias_size is None:
            self.register_parameter("bias", None)
        else:
            self.bias = nn.Parameter(torch.zeros(bias_size, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return bias_gelu(x, self.bias, self.approximate)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}, bias={self.bias is not None}"

    @classmethod
    def from_module(cls, m: nn.Module, bias: Optional[nn.Parameter] = None) -> "FusedBiasGeLU":
        """Replace an ``nn.GELU`` (keeps its ``approximate``); ``bias`` optionally takes over a Linear's
        bias Parameter (the caller then sets that Linear's bias to None)."""
        new = cls(None, getattr(m, "approximate", "none"))
        if bias is not None:
            new.register_parameter("bias", bias)
        new.train(m.training)
        return new
