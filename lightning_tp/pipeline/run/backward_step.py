"""The backward side of a pipeline step (a part of :class:`.executor.PipelineRunner`): a backward action, the dp
overlap's hooks and the hand-over of the step's gradients to Lightning. See docs/design/pipeline-run.md.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from .zb import SplitBackward, whole_functions

log = logging.getLogger("lightning.pytorch.lightning_tp")


class BackwardStep:
    """A training step's backward actions on this rank's stages, with the chunks it found run whole (compiled
    blocks, see .zb) and the strategy's dp overlap (``dp_overlap``, dp > 1)."""

    def __init__(self, module, layout):
        self.module, self.layout = module, layout
        self.dp_overlap = None  # the strategy's DPOverlap, hooked around each chunk's final pass (see syncing)
        self.whole_chunks = set()  # zero bubble: chunks whose backward B runs whole
        self.told = set()  # virtual stages whose weights taken in B were logged (see .zb.whole_functions)
        self.plan = None  # the training step's plan: its split backwards and each chunk's final passes

    def start(self, plan) -> None:
        """A training step on ``plan`` (a .loop.StepPlan) begins."""
        self.plan = plan
        if self.dp_overlap is not None:
            self.dp_overlap.restart()  # a step that raised may have left a count behind

    def syncing(self, a):
        """The dp overlap's hooks around a chunk's final weight-gradient pass of the step (its last W, or last
        B where unsplit or whole), else a plain context. See docs/design/pipeline-run.md."""
        overlap = self.dp_overlap
        final = a in self.plan.final or (a.chunk in self.whole_chunks and a in self.plan.final_b)
        if not final or overlap is None or not overlap.armed():
            return contextlib.nullcontext()
        return _hooked(overlap)

    def run(self, key, k, out, grad, inputs, input_grads, deferred, params) -> None:
        """One B (or whole backward) of microbatch and chunk ``key`` on virtual stage ``k``."""
        split = getattr(out, "_lightning_tp_grad_split", None)
        if split is not None:  # only the parts that need a gradient get one: the leading values (messages.pack)
            out = out[:split[1]]
        if not out.requires_grad:  # nothing of this stage's output depends on a trainable weight
            if k > 0:
                raise no_input_grad(k)
            lo, hi = self.layout.ranges[k]
            blocks = self.layout.blocks(self.module)
            if any(p.requires_grad for i in range(lo, hi + 1) for p in blocks[i].parameters()):
                raise ValueError(f"pipeline: virtual stage {k}'s output does not require grad though its blocks "
                                 f"hold trainable weights: a detach() or torch.no_grad() before the next stage, or "
                                 f"a reentrant checkpoint around a block whose input needs no grad (use "
                                 f"use_reentrant=False, or MegaStrategy(activation_checkpointing=True)).")
            if key in self.plan.split:  # a frozen first stage: no backward, as one process computes none there
                deferred[key] = _NoWeightGrad()
            return
        if key not in self.plan.split:
            torch.autograd.backward(out, grad)
            return
        # ZB: B computes only the input gradient now; W (the weight half, see .zb) runs later.
        split = SplitBackward(out, grad, inputs[key] if k > 0 else None, params)
        if split.whole or (split.split is not None and not split.groups):  # W has nothing left to do
            self.whole_chunks.add(key[1])
        if split.in_b and k not in self.told:
            self.told.add(k)
            log.info(f"pipeline: virtual stage {k} takes the weight gradients of {', '.join(whole_functions(split))} "
                     f"in B, with the input gradient: a custom autograd Function computing both would run twice "
                     f"if split (the rest of its weights are deferred to W)")
        g = split.input_grad()
        if g is not None:
            input_grads[key] = g
        deferred[key] = split

    @staticmethod
    def merge_grads(module, overlap=None) -> None:
        """Hand the step's gradients to Lightning after its zero_grad: the step's tensor becomes ``.grad``,
        what ``.grad`` held is added (after a dp all-reduce started in the step, ``overlap``). See
        docs/design/pipeline-run.md."""
        for p in module.parameters():
            fresh = getattr(p, "_pp_fresh_grad", None)
            if fresh is not None:
                if p.grad is not None and overlap is not None and overlap.started(p):
                    overlap.add_after_sync(fresh, p.grad)
                elif p.grad is not None:
                    fresh.add_(p.grad)
                p.grad = fresh
                p._pp_fresh_grad = None


@contextlib.contextmanager
def _hooked(overlap):
    overlap.hook()
    try:
        yield
    finally:
        overlap.remove()


def no_input_grad(k: int) -> ValueError:
    return ValueError(
        f"pipeline: no gradient reached the activation virtual stage {k} received, so none could go on to the "
        f"earlier stages. A reentrant checkpoint around a block (torch.utils.checkpoint(..., use_reentrant=True)) "
        f"is given the placeholders' input there, which does not require grad: use MegaStrategy("
        f"activation_checkpointing=True), or use_reentrant=False. (A block run under torch.no_grad() or a "
        f"detach() on a later stage does the same.)")


class _NoWeightGrad:
    """W of a stage whose output needs no gradient (every weight before it frozen)."""

    inp = None

    def weight_grad(self) -> None:
        pass
