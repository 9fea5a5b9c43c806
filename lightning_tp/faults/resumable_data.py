"""A training DataLoader that resumes mid-epoch: Lightning saves a loader's state only when it has one, and
otherwise replays the epoch from its start. This one records the batches the epoch had trained, and after a
restore skips that many of the next iteration (same sampler, same epoch: the same batches follow)."""

from __future__ import annotations

from typing import Callable

from torch.utils.data import DataLoader, IterableDataset


class _Skipping:
    """The loader's iterator, the first ``skip`` batches dropped at the first ``next`` (after set_epoch)."""

    def __init__(self, it, skip: int):
        self.it, self.skip = it, skip

    def __iter__(self):
        return self

    def __next__(self):
        while self.skip:
            self.skip -= 1
            next(self.it)
        return next(self.it)

    def __getattr__(self, name):
        return getattr(self.it, name)


class ResumableDataLoader(DataLoader):
    """torch's DataLoader with a state Lightning saves and restores: see the module's docstring."""

    def __iter__(self):
        it = super().__iter__()
        skip, self._lightning_tp_skip = self._lightning_tp_skip, 0
        return _Skipping(it, skip) if skip else it

    def state_dict(self) -> dict:
        consumed, replicas = self._lightning_tp_progress()
        return {"lightning_tp_batches": consumed, "replicas": replicas}

    def load_state_dict(self, state: dict) -> None:
        from lightning.pytorch.utilities.rank_zero import rank_zero_warn

        consumed, replicas = state.get("lightning_tp_batches", 0), state.get("replicas")
        if replicas != self._lightning_tp_progress()[1]:
            if consumed:
                rank_zero_warn(f"MegaStrategy: the checkpoint was saved {consumed} batches into an epoch at "
                               f"dp={replicas}; at this dp the epoch resumes from its start (Lightning's own "
                               f"behaviour). Save at epoch ends to change dp exactly.")
            return
        self._lightning_tp_skip = consumed if 0 < consumed < len(self) else 0


def resumable(loader, progress: Callable[[], tuple]):
    """``loader`` made resumable mid-epoch in place (torch's own DataLoader over a map-style dataset);
    ``progress()``: (batches of this epoch trained, dp), read when Lightning saves a checkpoint."""
    if type(loader) not in (DataLoader, ResumableDataLoader) or isinstance(loader.dataset, IterableDataset):
        return loader  # a subclass (its own __iter__, maybe its own state) or a stream: left as it is
    # ResumableDataLoader: one made here before, and passed again (Lightning rebuilds it by its class)
    loader.__class__ = ResumableDataLoader
    loader._lightning_tp_progress, loader._lightning_tp_skip = progress, 0
    return loader
