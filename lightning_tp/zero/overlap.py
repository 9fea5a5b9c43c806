"""zero=1's reduce-scatter overlapped with the backward: a bucket starts as soon as its gradients are final,
in order, as the all-reduce of zero=0 does (see ..dp_overlap); under a pipeline, in each chunk's final
backward pass. See docs/zero.md."""

from __future__ import annotations

from .shards import finish_reduce_scatters


class ZeroOverlap:
    """The early buckets of ``sharded`` (ShardedOptimizers) reduce-scattered while the backward runs; the
    rest (gradients summed over tp or stages first) after it. ``armed()``: this backward syncs; ``hooked``:
    hooks kept from now on (a pipeline's runner hooks them around each chunk's final pass instead)."""

    def __init__(self, sharded: list, armed, hooked: bool = True):
        self.sharded, self.armed = sharded, armed
        self.buckets = [b for z in sharded for b in z.buckets if b.early]
        self.early_buckets = len(self.buckets)
        self.bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b.params}
        for z in sharded:
            z.overlapped = True
        self.hooks = []
        self.keep_grads = not hooked  # a pipeline's runner still holds them (see add_after_sync)
        if hooked:
            self.hook()
        self._reset()

    def hook(self) -> None:
        if not self.hooks:
            self.hooks = [p.register_post_accumulate_grad_hook(self._ready) for b in self.buckets for p in b.params]

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []

    def restart(self) -> None:
        """Forget what a step that raised after starting buckets left behind."""
        self._reset()

    def _reset(self) -> None:
        self.seen, self.next, self.started_ = [set() for _ in self.buckets], 0, []
        self.taken, self.after = {}, []  # id(grad taken at launch) -> its parameter; (parameter, addend)

    def started(self, p) -> bool:
        return self.bucket_of.get(id(p), len(self.buckets)) < self.next

    def _ready(self, p) -> None:
        if not self.armed():
            return
        self.seen[self.bucket_of[id(p)]].add(id(p))
        while self.next < len(self.buckets) and len(self.seen[self.next]) == len(self.buckets[self.next].params):
            self._launch(self.next)

    def add_after_sync(self, grad, addend) -> None:
        """``grad`` (taken by a started reduce-scatter) ``+= addend`` once reduce-scattered: ``addend`` alike on
        every dp rank (what ``.grad`` held before a pipeline's step), added to this rank's slices of it."""
        self.after.append((self.taken[id(grad)], addend))

    def _launch(self, i: int) -> None:
        self.next = i + 1
        if self.keep_grads:
            self.taken.update({id(p.grad): p for p in self.buckets[i].params if p.grad is not None})
        self.started_.append(self.buckets[i].start_reduce_scatter(drop=not self.keep_grads))

    def finish(self) -> None:
        """Start the buckets not yet started (a parameter without a gradient here), then give each slice its
        gradient where any replica had one (the flags sent with the gradients, as ShardedOptimizer does)."""
        self.launched_early = self.next  # buckets the backward started (read by tests)
        while self.next < len(self.buckets):
            self._launch(self.next)
        finish_reduce_scatters(self.buckets, self.started_, 1.0 / self.sharded[0].mesh.replicas)
        for p, addend in self.after:
            b = self.buckets[self.bucket_of[id(p)]]
            for s in (s for s in b.slices if b.params[s.index] is p):
                part = addend.reshape(-1)[s.part]
                s.param.grad = part.clone() if s.param.grad is None else s.param.grad.add_(part)
        self._reset()
