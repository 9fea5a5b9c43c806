"""Cross-entropy over a vocab-parallel logits shard, never materialising the softmax (an online max and
sum-exp per row; O(N) floats all-reduced). See docs/design/kernels.md."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
import torch.nn.functional as F

from ._utils import block_size, fallback, num_warps, tl, triton, use_triton

#: Vocab block per loop step in the kernels (tests shrink it to exercise the online rescaling).
MAX_BLOCK = 8192


@triton.jit
def _ce_stats(X, Tgt, Stats, x_stride, V, vocab_start, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = X + row * x_stride
    m = float("-inf")
    d = 0.0
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # all -inf so far: keep d at 0, not NaN
        d = d * tl.exp(m - m_ref) + tl.sum(tl.exp(x - m_ref), axis=0)
        m = m_new
    t = tl.load(Tgt + row) - vocab_start
    here = (t >= 0) & (t < V)
    xt = tl.load(base + t, mask=here, other=0.0).to(tl.float32)
    tl.store(Stats + row * 3, m)
    tl.store(Stats + row * 3 + 1, d)
    tl.store(Stats + row * 3 + 2, tl.where(here, xt, 0.0))


@triton.jit
def _ce_grad(X, DX, Tgt, Lse, G, x_stride, dx_stride, V, vocab_start, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    t = tl.load(Tgt + row) - vocab_start
    lse = tl.load(Lse + row)
    g = tl.load(G + row)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < V
        x = tl.load(X + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
        p = tl.exp(x - lse)
        p = tl.where(cols == t, p - 1.0, p)
        tl.store(DX + row * dx_stride + cols, (p * g).to(DX.dtype.element_ty), mask=mask)


def _stats_torch(x: torch.Tensor, t: torch.Tensor, vocab_start: int, acc: torch.dtype) -> torch.Tensor:
    xf = x.to(acc)
    V = xf.shape[1]
    m = xf.amax(1)
    m_ref = m.masked_fill(m == float("-inf"), 0.0)
    d = torch.exp(xf - m_ref[:, None]).sum(1)
    tl_ = t - vocab_start
    here = (tl_ >= 0) & (tl_ < V)
    xt = xf.gather(1, tl_.clamp(0, max(V - 1, 0))[:, None]).squeeze(1)
    return torch.stack([m, d, torch.where(here, xt, torch.zeros_like(xt))], 1)


def _grad_torch(x, t, lse, g, vocab_start, out):
    xf = x.to(lse.dtype)
    V = xf.shape[1]
    p = torch.exp(xf - lse[:, None])
    tl_ = t - vocab_start
    here = (tl_ >= 0) & (tl_ < V)
    p.scatter_add_(1, tl_.clamp(0, max(V - 1, 0))[:, None], -here.to(p.dtype)[:, None])
    out.copy_(p * g[:, None])


def _chunks(n: int, chunk: Optional[int]):
    step = n if not chunk else max(1, int(chunk))
    for s in range(0, n, max(step, 1)):
        yield s, min(n, s + step)


class CrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, ignore_index, reduction, vocab_start, group, chunk, triton_path, inplace):
        N, V = logits.shape
        acc = torch.promote_types(logits.dtype, torch.float32)
        stats = torch.empty((N, 3), device=logits.device, dtype=acc)
        BLOCK = block_size(V, MAX_BLOCK)
        for s, e in _chunks(N, chunk):
            if triton_path:
                _ce_stats[(e - s,)](logits[s:e], target[s:e], stats[s:e], logits.stride(0), V, vocab_start,
                                    BLOCK=BLOCK, num_warps=num_warps(BLOCK))
            else:
                stats[s:e] = _stats_torch(logits[s:e], target[s:e], vocab_start, acc)
        m, d, xt = stats.unbind(1)
        if group is not None and dist.get_world_size(group) > 1:
            gm = m.clone()
            dist.all_reduce(gm, op=dist.ReduceOp.MAX, group=group)
            gm_ref = gm.masked_fill(gm == float("-inf"), 0.0)
            dt = torch.stack([d * torch.exp(m - gm_ref), xt])
            dist.all_reduce(dt, op=dist.ReduceOp.SUM, group=group)
            m, (d, xt) = gm, dt.unbind(0)
        lse = m + torch.log(d)
        valid = target != ignore_index
        loss = torch.where(valid, lse - xt, torch.zeros_like(lse))
        n_valid = valid.sum()
        if reduction == "mean":
            out = loss.sum() / n_valid.to(acc)
        elif reduction == "sum":
            out = loss.sum()
        else:
            out = loss
        ctx.save_for_backward(logits, target, lse, valid, n_valid)
        ctx.cfg = (reduction, vocab_start, chunk, triton_path, inplace)
        return out  # fp32 for 16-bit logits, as F.cross_entropy under autocast (a bf16 loss keeps 3 digits)

    @staticmethod
    def backward(ctx, grad_out):
        logits, target, lse, valid, n_valid = ctx.saved_tensors
        reduction, vocab_start, chunk, triton_path, inplace = ctx.cfg
        g = grad_out.to(lse.dtype)
        if reduction == "mean":
            g = g / n_valid.clamp_min(1).to(lse.dtype)
        g = torch.where(valid, g.expand_as(lse), torch.zeros_like(lse)).contiguous()
        dx = logits if inplace else torch.empty_like(logits)
        N, V = logits.shape
        BLOCK = block_size(V, MAX_BLOCK)
        for s, e in _chunks(N, chunk):
            if triton_path:
                _ce_grad[(e - s,)](logits[s:e], dx[s:e], target[s:e], lse[s:e], g[s:e], logits.stride(0),
                                   dx.stride(0), V, vocab_start, BLOCK=BLOCK, num_warps=num_warps(BLOCK))
            else:
                _grad_torch(logits[s:e], target[s:e], lse[s:e], g[s:e], vocab_start, dx[s:e])
        return dx, None, None, None, None, None, None, None, None


def fused_cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
                        reduction: str = "mean", vocab_start: int = 0, group=None,
                        chunk_tokens: Optional[int] = None, *, inplace_backward: bool = False) -> torch.Tensor:
    """Cross-entropy of (N, V_local) logits (or (..., V)) against global-id targets; with ``group=None``
    equal to ``F.cross_entropy``. See docs/design/kernels.md."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    out_shape = target.shape
    x = logits.reshape(-1, logits.shape[-1])
    if x.stride(-1) != 1:
        x = x.contiguous()
    t = target.reshape(-1).to(torch.long).contiguous()
    if t.shape[0] != x.shape[0]:
        raise ValueError(f"target has {t.shape[0]} rows, logits {x.shape[0]}")
    tri = use_triton("cross_entropy", x)
    loss = CrossEntropyFunction.apply(x, t, int(ignore_index), reduction, int(vocab_start), group, chunk_tokens,
                                      tri, bool(inplace_backward))
    return loss.view(out_shape) if reduction == "none" else loss


class FusedCrossEntropyLoss(nn.Module):
    """``nn.CrossEntropyLoss`` replacement, optionally vocab-parallel (``vocab_start``, ``group``)."""

    def __init__(self, ignore_index: int = -100, reduction: str = "mean", vocab_start: int = 0, group=None,
                 chunk_tokens: Optional[int] = None, inplace_backward: bool = False):
        super().__init__()
        self.ignore_index, self.reduction = ignore_index, reduction
        self.vocab_start, self.group, self.chunk_tokens = vocab_start, group, chunk_tokens
        self.inplace_backward = inplace_backward
        self.register_buffer("weight", None)  # a buffer, as in nn.CrossEntropyLoss (state_dict parity)
        self.label_smoothing = 0.0

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.weight is not None or self.label_smoothing:
            parallel = self.group is not None and dist.get_world_size(self.group) > 1
            if parallel:
                raise NotImplementedError("class weights / label smoothing are not supported vocab-parallel")
            fallback("cross_entropy", "class weights / label smoothing are not fused")
            return F.cross_entropy(logits, target, weight=self.weight, ignore_index=self.ignore_index,
                                   reduction=self.reduction, label_smoothing=self.label_smoothing)
        return fused_cross_entropy(logits, target, self.ignore_index, self.reduction, self.vocab_start, self.group,
                                   self.chunk_tokens, inplace_backward=self.inplace_backward)

    @classmethod
    def from_module(cls, m: nn.Module, vocab_start: int = 0, group=None,
                    chunk_tokens: Optional[int] = None) -> "FusedCrossEntropyLoss":
        """Replace an ``nn.CrossEntropyLoss`` (its ignore_index, reduction, weight, label_smoothing)."""
        new = cls(getattr(m, "ignore_index", -100), getattr(m, "reduction", "mean"), vocab_start, group, chunk_tokens)
        new.register_buffer("weight", getattr(m, "weight", None))
        new.label_smoothing = float(getattr(m, "label_smoothing", 0.0))
        new.train(m.training)
        return new
