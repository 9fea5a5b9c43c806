"""Microbatches: splitting a batch along dim 0, how many a batch gets (an epoch's smaller last batch: the
fewest, at least ``microbatches``, that divide it), merging outputs back. See docs/design/pipeline-run.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch.utils._pytree import tree_map


def split_batch(batch, m: int, path: str = "batch") -> list:
    """``m`` microbatches along dim 0 of every tensor in the batch."""
    if m == 1:
        return [batch]
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0 or batch.shape[0] % m:
            size = "a scalar" if batch.dim() == 0 else f"size {batch.shape[0]} along dim 0"
            raise ValueError(f"microbatches={m} must divide the batch, but {path} has {size}; "
                             f"set MegaStrategy(microbatches=...) to a divisor of the batch size (checked on an "
                             f"epoch's first batch and a resumed run's first; a smaller last batch is split "
                             f"otherwise).")
        return list(batch.chunk(m))
    if isinstance(batch, Mapping):
        parts = {k: split_batch(v, m, f"{path}[{k!r}]") for k, v in batch.items()}
        return [type(batch)({k: parts[k][i] for k in batch}) for i in range(m)]
    if isinstance(batch, (list, tuple)):
        parts = [split_batch(v, m, f"{path}[{i}]") for i, v in enumerate(batch)]
        rows = [[p[i] for p in parts] for i in range(m)]
        return [type(batch)(*r) if hasattr(batch, "_fields") else type(batch)(r) for r in rows]
    raise ValueError(f"{path} is a {type(batch).__name__}, which cannot be split along dim 0 into microbatches; "
                     f"make the batch tensors (or lists/dicts of tensors), or use microbatches=1.")


def rows(batch) -> list:
    """The dim-0 size of every tensor in the batch, None for a scalar, -1 for a leaf that is no tensor."""
    if isinstance(batch, torch.Tensor):
        return [batch.shape[0] if batch.dim() else None]
    if isinstance(batch, Mapping):
        return [r for v in batch.values() for r in rows(v)]
    if isinstance(batch, (list, tuple)):
        return [r for v in batch for r in rows(v)]
    return [-1]


def must_divide(hook: str, batch_idx: int, first_of_run: bool, batches_per_epoch) -> bool:
    """Whether ``microbatches`` not dividing this batch is a wrong batch size rather than an epoch's smaller
    last batch: an epoch's (or the run's) first training batch, unless it is the epoch's last. See
    docs/design/pipeline-run.md."""
    if hook != "training_step" or not (batch_idx == 0 or first_of_run):
        return False
    return not (isinstance(batches_per_epoch, int) and batch_idx == batches_per_epoch - 1)


def batches_per_epoch(module):
    """Lightning's training batches per epoch (1: a dataset smaller than one batch), if known."""
    try:
        return module.trainer.num_training_batches
    except (AttributeError, RuntimeError):  # no trainer attached
        return None


def resumable_loader(module) -> bool:
    """Whether the training loaders save their place (``state_dict``) themselves: a resumed run then goes on
    with the epoch's next batch, whose size may rightly differ (bucketing, a short tail). torch's DataLoader,
    made resumable by the strategy, has fixed batch sizes: its resumed first batch is still checked."""
    try:
        from lightning.fabric.utilities.types import _Stateful

        from ...faults.resumable_data import ResumableDataLoader

        loader = module.trainer.fit_loop._combined_loader
        return loader is not None and all(isinstance(x, _Stateful) and not isinstance(x, ResumableDataLoader)
                                          for x in loader.flattened)
    except (AttributeError, RuntimeError, ImportError):
        return False


def microbatches_for(batch, m: int, strict: bool) -> int:
    """How many microbatches this batch gets: ``m`` where it divides every tensor's dim 0 or where ``strict``,
    else the fewest, at least ``m``, that divide it. See docs/design/pipeline-run.md."""
    sizes = [r for r in rows(batch) if r != -1]  # a string: split_batch says so, not a size
    if m == 1 or not sizes or None in sizes:
        return m  # split_batch says what cannot be split
    divisor = math.gcd(*sizes)
    if divisor % m == 0 or strict:
        return m
    return min(d for d in range(min(m, divisor), divisor + 1) if divisor % d == 0)


class MicrobatchCounts:
    """How many microbatches each batch of a run gets (see microbatches_for), warning once per hook where it is
    not ``m``; the first training batch of a run is checked (see must_divide)."""

    def __init__(self, module, m: int):
        self.module, self.m = module, m
        self.trained = False  # a training step ran in this run
        self.warned = set()

    def new_run(self) -> None:
        """A new fit or evaluation on the same stages: its first batch is checked again."""
        self.trained = False

    def of(self, batch, hook: str, batch_idx: int) -> int:
        """This batch's microbatch count."""
        first_of_run = not self.trained and not resumable_loader(self.module)
        m = microbatches_for(batch, self.m, strict=must_divide(hook, batch_idx, first_of_run,
                                                               batches_per_epoch(self.module)))
        self.trained = self.trained or hook == "training_step"
        if m != self.m and hook not in self.warned:
            from lightning.pytorch.utilities import rank_zero_warn

            self.warned.add(hook)
            rank_zero_warn(f"{hook}: a batch that microbatches={self.m} does not divide (an epoch's smaller last "
                           f"batch?) runs as {m} microbatches, none larger than usual (warned once).")
        return m


def merge_outputs(outputs: list):
    """The inverse of :func:`split_batch` for what the user's step returned per microbatch: tensors joined (0-d
    ones averaged or summed), mappings and sequences merged, equal values kept once. See
    docs/design/pipeline-run.md."""
    first = outputs[0]
    if len(outputs) == 1:
        return first
    if all(isinstance(o, torch.Tensor) for o in outputs):
        if first.dim() and all(o.shape[1:] == first.shape[1:] for o in outputs):
            return torch.cat(outputs)
        if not first.dim() and all(not o.dim() for o in outputs):
            stacked = torch.stack(outputs)
            return stacked.mean() if stacked.is_floating_point() else stacked.sum()
        return list(outputs)
    if all(type(o) is list for o in outputs) and not any(
            isinstance(x, (torch.Tensor, Mapping, list, tuple)) for o in outputs for x in o):
        return [x for o in outputs for x in o]  # plain values, one per sample (decoded text): joined
    if all(isinstance(o, Mapping) for o in outputs) and all(o.keys() == first.keys() for o in outputs):
        return type(first)({k: merge_outputs([o[k] for o in outputs]) for k in first})
    if all(isinstance(o, (list, tuple)) and type(o) is type(first) and len(o) == len(first) for o in outputs):
        merged = [merge_outputs([o[i] for o in outputs]) for i in range(len(first))]
        return type(first)(*merged) if hasattr(first, "_fields") else type(first)(merged)
    try:
        if all(o == first for o in outputs[1:]):  # None, a string, a number the same in every microbatch
            return first
    except Exception:  # noqa: BLE001 - objects whose == is not a bool (arrays): listed below
        pass
    return list(outputs)


def split_marked(batch, m: int) -> list:
    """The batch's microbatches, their tensors marked: a batch tensor never takes a received
    activation in place (see stage._takes_in_place)."""
    micro = split_batch(batch, m)
    tree_map(_kept, micro)
    return micro


def _kept(t):
    if isinstance(t, torch.Tensor):
        t._lightning_tp_placeholder = True
        if t._is_view():  # a chunk of the batch, or of the broadcast buffer: a view of it is the batch too
            t._base._lightning_tp_placeholder = True
    return t
