"""Data-parallel gradient all-reduce overlapped with the backward pass: buckets start, in order, as their
gradients become final (as DDP does). See docs/design/grads-and-dp.md."""

from __future__ import annotations

from .grads import BUCKET_BYTES, adopt, chunked, settle, start_all_reduce, with_flags
from ..marks import marks_of


class BucketOverlap:
    """Buckets of parameters started in order as autograd finalizes their gradients (hooks), the rest at
    :meth:`finish`. Subclasses say what a bucket's parameters are and what starting and settling one does."""

    def __init__(self, armed, hooked: bool):
        self.armed = armed
        self.bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in self._params(b)}
        self.hooks = []
        if hooked:
            self.hook()
        self._reset()

    def _params(self, bucket) -> list:
        return bucket

    def hook(self) -> None:
        """Count each parameter's gradient into its bucket as autograd accumulates it."""
        if not self.hooks:
            self.hooks = [p.register_post_accumulate_grad_hook(self._ready) for b in self.buckets for p in self._params(b)]

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []

    def restart(self) -> None:
        """Forget what a step that raised after starting buckets left behind (none: no-op)."""
        self._reset()

    def _reset(self) -> None:
        self.seen, self.next, self.after = [set() for _ in self.buckets], 0, []

    def started(self, p) -> bool:
        """Whether ``p``'s bucket is being synced already (its gradient was taken at launch)."""
        return self.bucket_of.get(id(p), len(self.buckets)) < self.next

    def _ready(self, p) -> None:
        if not self.armed() or self.bucket_of[id(p)] >= self.early_buckets:
            return
        self.seen[self.bucket_of[id(p)]].add(id(p))  # a set: a hook firing twice counts once
        while self.next < self.early_buckets and len(self.seen[self.next]) == len(self._params(self.buckets[self.next])):
            self.next += 1
            self._launch(self.next - 1)

    def finish(self) -> None:
        """Launch the buckets not yet started (unused parameters, late ones), then settle them all."""
        self.launched_early = self.next  # buckets the backward started (read by tests)
        while self.next < len(self.buckets):
            self.next += 1
            self._launch(self.next - 1)
        self._settle()
        self._reset()

    def _launch(self, i: int) -> None:
        raise NotImplementedError

    def _settle(self) -> None:
        raise NotImplementedError


class DPOverlap(BucketOverlap):
    """zero=0's all-reduce of the dp gradients, bucket by bucket during the backward."""

    def __init__(self, params, group, dp: int, armed, bucket_bytes: int = BUCKET_BYTES, hooked: bool = True):
        """``armed()``: whether this backward is the one to sync (False while Lightning accumulates).
        ``hooked``: register the hooks now and keep them (else :meth:`hook` / :meth:`remove`)."""
        self.group, self.scale = group, 1.0 / dp
        params = [p for p in params if p.requires_grad]
        # ``pp_late_sync`` (see marks): gradients no single backward pass finalizes on this rank (an encoder-decoder's
        # embedding used by two of its chunks, a copy it holds without running): buckets of their own, last,
        # left to finish()
        late = [p for p in params if marks_of(p).pp_late_sync]
        self.buckets = _buckets([p for p in params if not marks_of(p).pp_late_sync], bucket_bytes)
        self.early_buckets = len(self.buckets)  # those a backward may start (read by tests)
        self.buckets += _buckets(late, bucket_bytes) if late else []
        super().__init__(armed, hooked)

    def _reset(self) -> None:
        super()._reset()
        self.works, self.launched = [], []

    def add_after_sync(self, grad, addend) -> None:
        """``grad += addend`` once ``grad``'s started all-reduce has written its average back: for a
        value every dp rank holds alike (a gradient synced at an earlier step and not zeroed)."""
        self.after.append((grad, addend))

    def _launch(self, i: int) -> None:
        # a parameter this replica's batch missed takes part as zeros; one frozen since setup (alike on
        # every replica) does not; a stage without trainable parameters has an empty bucket
        params = [p for p in self.buckets[i] if p.requires_grad]
        if not params:
            return
        tensors = with_flags(params)
        self.works.append(start_all_reduce(tensors, self.group))
        self.launched.append((params, tensors))

    def _settle(self) -> None:
        """Wait for every all-reduce and average into .grad."""
        settle(self.works, self.scale)
        for params, tensors in self.launched:
            adopt(params, tensors)
        for grad, addend in self.after:
            grad.add_(addend)


def _buckets(params: list, bucket_bytes: int) -> list:
    """Reverse parameter order (the order backward produces gradients), grads.chunked's rule (one dtype a
    bucket); one empty bucket for no parameters."""
    return list(chunked(params[::-1], bucket_bytes)) or [[]]
