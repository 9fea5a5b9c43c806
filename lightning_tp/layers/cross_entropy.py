"""Cross-entropy over vocab-sharded logits, never needing the full (tokens x vocab) logits.
See docs/design/tensor-parallel.md."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .. import comm


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_start, vocab_size, group, ignore_index):
        _check_targets(target, vocab_size, ignore_index)
        x = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp32, or fp64 under 64-true
        n, v_local = x.shape
        valid_cols = vocab_size - vocab_start  # columns past it are padding rows of the LM head
        if valid_cols < v_local:
            x = x.clone()
            x[:, max(valid_cols, 0):] = float("-inf")
        row_max = comm.all_reduce(x.max(dim=-1).values, group, op=dist.ReduceOp.MAX)
        x = x - row_max.unsqueeze(-1)
        local_t = target - vocab_start
        mine = (local_t >= 0) & (local_t < v_local)
        idx = local_t.clamp(0, v_local - 1)
        target_logit = x.gather(1, idx.unsqueeze(1)).squeeze(1) * mine
        exp = x.exp_()  # x is a fresh tensor here
        stats = comm.all_reduce(torch.stack([exp.sum(-1), target_logit]), group)
        sum_exp, target_logit = stats[0], stats[1]
        ignored = target == ignore_index
        loss = (sum_exp.log() - target_logit).masked_fill(ignored, 0.0)
        exp.div_(sum_exp.unsqueeze(-1))  # softmax, kept for backward
        ctx.save_for_backward(exp, idx, mine & ~ignored, ignored)
        ctx.dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, idx, hit, ignored = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(1, idx.unsqueeze(1), -hit.to(grad.dtype).unsqueeze(1))
        grad.mul_((grad_loss * ~ignored).unsqueeze(-1))
        return grad.to(ctx.dtype), None, None, None, None, None


def _check_targets(target, vocab_size: int, ignore_index: int) -> None:
    """As torch's cross-entropy does: a target outside the vocabulary (padding marked -1 where
    ignore_index is -100) is an error, not a target logit of 0. Every rank holds the same targets,
    so every rank raises, before any collective. On a GPU the check stays on the device."""
    bad = (target != ignore_index) & ((target < 0) | (target >= vocab_size))
    if target.device.type == "cuda":
        torch._assert_async(~bad.any(), "vocab-parallel cross-entropy: a target is out of bounds")
    elif bad.any():
        raise IndexError(f"Target {int(target[bad][0])} is out of bounds (vocabulary of {vocab_size}, "
                         f"ignore_index={ignore_index}).")


def vocab_parallel_cross_entropy(logits, target, vocab_start, vocab_size, group, ignore_index=-100):
    """Per-token loss (no reduction) for logits holding columns [vocab_start, vocab_start + V_local)."""
    return _VocabParallelCE.apply(logits, target, vocab_start, vocab_size, group, ignore_index)


class VocabParallelCrossEntropy(nn.Module):
    """Drop-in for ``nn.CrossEntropyLoss`` fed by a column-parallel LM head that does not gather."""

    def __init__(self, head, ignore_index=-100, reduction="mean"):
        super().__init__()
        self._head = [head]  # a list, so the head is not registered twice as a submodule
        self.ignore_index, self.reduction = ignore_index, reduction
        self.fused = False  # MegaStrategy(kernels=...) routes to the fused Triton kernel

    @classmethod
    def from_module(cls, loss: nn.CrossEntropyLoss, head, name: str):
        if loss.weight is not None or loss.label_smoothing:
            raise ValueError(f"{name}: vocab-parallel cross-entropy supports neither class weights nor label "
                             f"smoothing; remove them or leave the loss out of the plan.")
        return cls(head, loss.ignore_index, loss.reduction)

    def forward(self, logits, target):
        head = self._head[0]
        if logits.shape[-1] == head.full_out != head.out_features:  # the head gathered (eval mode)
            return F.cross_entropy(logits, target, ignore_index=self.ignore_index, reduction=self.reduction)
        if logits.dim() != 2 or logits.shape[-1] != head.out_features:
            raise ValueError(
                f"vocab-parallel cross-entropy expects logits of shape (tokens, {head.out_features}) (this rank's "
                f"vocab shard), got {tuple(logits.shape)}. Flatten with logits.view(-1, logits.size(-1)).")
        if self.fused and head.full_out == head.out_features * head.ctx.world:  # no vocab padding to mask
            from ..kernels import fused_cross_entropy

            _check_targets(target, head.full_out, self.ignore_index)
            return fused_cross_entropy(logits, target, self.ignore_index, self.reduction, head.vocab_start,
                                       head.ctx.group)
        loss = vocab_parallel_cross_entropy(logits, target, head.vocab_start, head.full_out, head.ctx.group,
                                            self.ignore_index)
        if self.reduction == "none":
            return loss
        if self.reduction == "sum":
            return loss.sum()
        return loss.sum() / (target != self.ignore_index).sum()
