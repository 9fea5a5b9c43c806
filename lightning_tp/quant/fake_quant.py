"""Symmetric fake quantization with straight-through gradients (the QAT building blocks): per-row weight
scales, per-tensor activation ranges ("ema", "delayed", "learned"). See docs/design/quant.md."""

from __future__ import annotations

import math
import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from .. import comm
from ..pipeline.run.backward_phase import halves

EPS = 1e-8  # smallest scale: an all-zero row or tensor (padding, dead units) quantizes to zeros
RANGE_MODES = ("ema", "learned", "delayed")
# "delayed" quantizer -> (the MAX of this rank's local absmax since its last fold, reduced over ranks
# just before the fold; its layer's weight or None).
# Kept here, not on the module, so that a deepcopy or a loaded state dict never carries a stale value.
_PENDING = weakref.WeakKeyDictionary()
_FOLD_HOOK = []  # the global optimizer step post-hook, registered once


def _fold_delayed(optimizer, *_) -> None:
    """After a (successful) optimizer step: the delayed quantizers whose layer it updates fold the
    absmax their step saw. A GAN's two optimizers each fold their own model's ranges."""
    if not _PENDING:  # the hook stays registered for the process: most steps have nothing to fold
        return
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    zero = getattr(optimizer, "_lightning_tp_zero", None)  # zero=1 steps slices: its layers' weights too
    if zero is not None:
        stepped |= {id(p) for params in zero.original for p in params}
    due = [q for q, (_, owner) in list(_PENDING.items())
           if owner is None or id(owner) in stepped or not owner.requires_grad]
    _reduce_pending(due)
    for q in due:
        q.fold()


def _reduce_pending(quantizers: list) -> None:
    """The MAX over ranks of what each quantizer recorded locally this step, for all of them at once: one
    all-reduce per group (tp, dp). See docs/design/quant.md."""
    by_groups: dict = {}
    for q in quantizers:
        by_groups.setdefault(q.range_groups(), []).append(q)
    for groups, qs in by_groups.items():
        if all(comm.group_size(g) == 1 for g in groups):
            continue
        reduced = reduce_max(torch.stack([_PENDING[q][0].reshape(()) for q in qs]), *groups)
        for q, m in zip(qs, reduced):
            _PENDING[q] = m, _PENDING[q][1]


def qmax_of(bits: int) -> int:
    return 2 ** (bits - 1) - 1


def quantize(x: torch.Tensor, scale: torch.Tensor, qmax: int) -> torch.Tensor:
    """Integer codes (still float) of ``x`` on the grid ``scale * [-qmax, qmax]``: round-half-even of
    ``x * (1 / scale)``, the exact arithmetic of PyTorch's fused fake-quant ops used in training."""
    return torch.clamp(torch.round(x * (1.0 / scale)), -qmax, qmax)


def reduce_max(t: torch.Tensor, *groups) -> torch.Tensor:
    """MAX all-reduce over each group given (``None`` groups are skipped; exact, order-free)."""
    for g in groups:
        if g is not None and comm.group_size(g) > 1:
            t = comm.all_reduce(t.contiguous(), g, op=dist.ReduceOp.MAX)
    return t


def weight_scale(w: torch.Tensor, bits: int, group=None) -> torch.Tensor:
    """Per-output-row scale ``absmax / qmax``, shape (out,). ``group``: the tp group of a row-parallel
    weight, whose rows are split along the input dim, so the row absmax is a MAX over ranks."""
    amax = reduce_max(w.detach().abs().amax(dim=1).float(), group)
    return (amax / qmax_of(bits)).clamp_min(EPS)  # fp32 whatever the weight's dtype


def fake_quant(x: torch.Tensor, scale: torch.Tensor, qmax: int) -> torch.Tensor:
    """``quantize(x) * scale`` with a 0-d (per-tensor) or (out,) (per-row) ``scale`` and a straight-through
    gradient, via PyTorch's fused ops. See docs/design/quant.md."""
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    s = scale.detach().float()
    zero = torch.zeros(s.shape, dtype=torch.int32, device=x.device)
    if s.dim() == 0:
        out = torch.fake_quantize_per_tensor_affine(xf, s, zero, -qmax, qmax)
    else:
        out = torch.fake_quantize_per_channel_affine(xf, s, zero, 0, -qmax, qmax)
    return out.to(x.dtype)


def fake_quant_weight(w: torch.Tensor, bits: int, group=None) -> torch.Tensor:
    """Per-row symmetric fake quant of a (out, in) weight; see :func:`weight_scale` for ``group``."""
    return fake_quant_weight_with_scale(w, bits, group)[0]


def fake_quant_weight_with_scale(w: torch.Tensor, bits: int, group=None):
    """``(fake-quantized w, its per-row fp32 scale)``."""
    scale = weight_scale(w, bits, group).float()
    return fake_quant(w, scale, qmax_of(bits)), scale


class _LSQ(torch.autograd.Function):
    """Fake quant with a learned clip ``alpha`` (scale alpha / Q) and LSQ's gradient for alpha, SUM
    all-reduced over ``group``. See docs/design/quant.md."""

    splits_backward = True  # each half of a split backward does its own work (see backward_phase.halves)

    @staticmethod
    def forward(ctx, x, alpha, qmax, grad_scale, group):
        scale = alpha / qmax
        ctx.save_for_backward(x, scale)
        ctx.qmax, ctx.grad_scale, ctx.group = qmax, grad_scale, group
        return quantize(x, scale, qmax) * scale

    @staticmethod
    def backward(ctx, g):
        return halves(ctx, lambda wanted: _LSQ._grads(ctx, g, wanted), 5, (1,), joint=True)

    @staticmethod
    def _grads(ctx, g, wanted):
        x, scale = ctx.saved_tensors
        v = x * (1.0 / scale)
        inside = v.abs() <= ctx.qmax
        d_alpha = torch.where(inside, (torch.round(v) - v) / ctx.qmax, torch.sign(v))
        g_alpha = (g * d_alpha).sum().float() * ctx.grad_scale
        if ctx.group is not None:
            g_alpha = comm.all_reduce(g_alpha.reshape(1), ctx.group).reshape(())
        return g * inside, g_alpha.to(scale.dtype), None, None, None


class ActQuantizer(nn.Module):
    """Per-tensor activation fake quant with an EMA, delayed or learned clip range.
    Arguments (``tp_ctx``, ``sharded``, ``partial_grad``, ``dp_group``; ``observing``): docs/design/quant.md."""

    def __init__(self, bits: int = 8, range_mode: str = "ema", momentum: float = 0.95, tp_ctx=None,
                 sharded: bool = False, partial_grad: bool = False, dp_group=None):
        super().__init__()
        if range_mode not in RANGE_MODES:
            raise ValueError(f"unknown activation range mode {range_mode!r}; choose one of {list(RANGE_MODES)}.")
        self.bits, self.qmax, self.range_mode, self.momentum = bits, qmax_of(bits), range_mode, momentum
        self.tp_ctx, self.sharded, self.partial_grad, self.dp_group = tp_ctx, sharded, partial_grad, dp_group
        self.register_buffer("amax", torch.zeros(()))
        self.register_buffer("initialized", torch.zeros((), dtype=torch.bool))
        self.clip = nn.Parameter(torch.ones(())) if range_mode == "learned" else None
        self.observing = False
        self._observed = 0
        self._known_init = False  # host-side cache of `initialized`: no device sync per forward

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        """Loading a plain fp32 checkpoint into a QAT model is allowed: the ranges then start unset."""
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        for key in ("amax", "initialized", "clip"):
            if prefix + key in missing_keys:
                missing_keys.remove(prefix + key)
        self._known_init = False
        _PENDING.pop(self, None)  # a delayed range restarts from what was loaded

    @property
    def is_initialized(self) -> bool:
        if not self._known_init:
            self._known_init = bool(self.initialized)
        return self._known_init

    @property
    def _tp_group(self):
        return getattr(self.tp_ctx, "group", None)

    def range_groups(self) -> tuple:
        """The groups whose ranks see parts of one batch of this activation: MAX-reduced over."""
        return self._tp_group if self.sharded else None, self.dp_group

    def local_amax(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == 0:
            return x.new_zeros(1, dtype=torch.float32)
        lo, hi = torch.aminmax(x.detach())  # one pass instead of abs() then amax()
        return torch.maximum(-lo, hi).float().reshape(1)

    def batch_amax(self, x: torch.Tensor) -> torch.Tensor:
        return reduce_max(self.local_amax(x), *self.range_groups()).reshape(())

    @torch.no_grad()
    def _set_range(self, value: torch.Tensor) -> None:
        self.amax.copy_(value)
        self.initialized.fill_(True)
        self._known_init = True
        if self.clip is not None:
            self.clip.copy_(value.clamp_min(EPS))

    def scale(self) -> torch.Tensor:
        """The inference scale (what :func:`~lightning_tp.quant.convert` bakes in)."""
        if not self.is_initialized:
            hint = (" It is a delayed range with batches recorded but never folded: it folds after "
                    "optimizer.step() (a loop without one never sets it).") if self in _PENDING else ""
            raise RuntimeError("activation range never set: train with QAT or run quant.calibrate() first." + hint)
        if self.clip is not None:  # the same arithmetic as the forward's, so int8 == fake quant
            return self.clip.detach().abs().clamp_min(EPS).float() / self.qmax
        return (self.amax.float() / self.qmax).clamp_min(EPS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quantize_with_scale(x)[0]

    def quantize_with_scale(self, x: torch.Tensor, owner: nn.Parameter | None = None):
        """``(fake-quantized x, the 0-d scale it used)``; the scale is ``None`` (x unchanged) while observing or
        before a delayed range's first fold. ``owner``: the layer's weight. See docs/design/quant.md."""
        if self.observing:  # PTQ calibration: the range is the mean of the batches' absmax
            with torch.no_grad():
                m = self.batch_amax(x)
                self._set_range((self.amax * self._observed + m) / (self._observed + 1) if self._observed else m)
                self._observed += 1
            return x, None
        if not self.is_initialized and not self.training:  # uncalibrated, in eval: this batch's range
            scale = (self.batch_amax(x) / self.qmax).clamp_min(EPS)
            return fake_quant(x, scale, self.qmax), scale
        if self.clip is not None:
            if not self.is_initialized:
                self._set_range(self.batch_amax(x))
            group = self._tp_group if self.partial_grad else None
            numel = x.numel() * (comm.group_size(self._tp_group) if self.sharded else 1)
            alpha = self.clip.abs().clamp_min(EPS)
            xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x  # as in fake_quant()
            a = alpha.to(xf.dtype)
            out = _LSQ.apply(xf, a, self.qmax, 1.0 / math.sqrt(numel * self.qmax), group).to(x.dtype)
            return out, (a / self.qmax).detach()
        if self.range_mode == "delayed" and self.training:  # record now, reduce and fold after the step
            self._record(self.local_amax(x).reshape(()), owner)
            if not self.is_initialized:
                return x, None
        elif self.training:  # update first, then quantize with the updated range (frozen in eval)
            with torch.no_grad():
                m = self.batch_amax(x)
                if self.is_initialized:
                    self.amax.mul_(self.momentum).add_(m * (1.0 - self.momentum))
                else:
                    self._set_range(m)
        scale = (self.amax.float() / self.qmax).clamp_min(EPS)
        return fake_quant(x, scale, self.qmax), scale

    @torch.no_grad()
    def _record(self, m: torch.Tensor, owner) -> None:
        m = torch.nan_to_num(m, nan=0.0, posinf=0.0)  # an overflowing batch must not become the range (no sync)
        _PENDING[self] = (torch.maximum(_PENDING[self][0], m) if self in _PENDING else m), owner
        if not _FOLD_HOOK:
            _FOLD_HOOK.append(register_optimizer_step_post_hook(_fold_delayed))

    @torch.no_grad()
    def fold(self) -> None:
        """``"delayed"``: fold the step's absmax into the range (the first step's sets it)."""
        pending = _PENDING.pop(self, (None, None))[0]
        if pending is None:
            return
        if self.is_initialized:  # a step that saw nothing finite (pending 0) leaves the range alone
            ema = self.amax * self.momentum + pending * (1.0 - self.momentum)
            self.amax.copy_(torch.where(pending > 0, ema, self.amax))
        else:
            self._set_range(pending)

    def extra_repr(self) -> str:
        return f"bits={self.bits}, range={self.range_mode}, sharded={self.sharded}"
