"""zero=1's reduce-scatter overlapped with the backward: a bucket starts as soon as its gradients are final,
in order, as the all-reduce of zero=0 does (see ..overlap); under a pipeline, in each chunk's final
backward pass. See docs/zero.md."""

from __future__ import annotations

from ..overlap import BucketOverlap
from .shards import finish_reduce_scatters


class ZeroOverlap(BucketOverlap):
    """The early buckets of ``sharded`` (ShardedOptimizers) reduce-scattered while the backward runs; the
    rest (gradients summed over tp or stages first) after it. ``armed()``: this backward syncs; ``hooked``:
    hooks kept from now on (a pipeline's runner hooks them around each chunk's final pass instead)."""

    def __init__(self, sharded: list, armed, hooked: bool = True):
        self.sharded = sharded
        self.buckets = [b for z in sharded for b in z.buckets if b.early]
        self.early_buckets = len(self.buckets)
        for z in sharded:
            z.overlapped = True
        self.keep_grads = not hooked  # a pipeline's runner still holds them (see add_after_sync)
        super().__init__(armed, hooked)

    def _params(self, bucket) -> list:
        return bucket.params

    def _reset(self) -> None:
        super()._reset()
        self.started_, self.taken = [], {}  # id(grad taken at launch) -> its parameter

    def add_after_sync(self, grad, addend) -> None:
        """``grad`` (taken by a started reduce-scatter) ``+= addend`` once reduce-scattered: ``addend`` alike on
        every dp rank (what ``.grad`` held before a pipeline's step), added to this rank's slices of it."""
        self.after.append((self.taken[id(grad)], addend))

    def _launch(self, i: int) -> None:
        if self.keep_grads:
            self.taken.update({id(p.grad): p for p in self.buckets[i].params if p.grad is not None})
        self.started_.append(self.buckets[i].start_reduce_scatter(drop=not self.keep_grads))

    def _settle(self) -> None:
        """Give each slice its gradient where any replica had one (the flags sent with the gradients, as
        ShardedOptimizer does), and what was added after the sync started."""
        finish_reduce_scatters(self.buckets, self.started_, 1.0 / self.sharded[0].mesh.replicas)
        for p, addend in self.after:
            b = self.buckets[self.bucket_of[id(p)]]
            for s in (s for s in b.slices if b.params[s.index] is p):
                part = addend.reshape(-1)[s.part]
                s.param.grad = part.clone() if s.param.grad is None else s.param.grad.add_(part)
