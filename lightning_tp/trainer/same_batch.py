"""One batch for every rank of a model copy: the first rank's, broadcast over the tp x pp group.
See docs/design/strategy.md."""

from __future__ import annotations

import pickle
from dataclasses import dataclass

import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import apply_to_collection


@dataclass(frozen=True)
class _Slot:
    """Where a tensor of the batch was: its index among the batch's tensors and how to rebuild it."""

    index: int
    shape: tuple
    dtype: torch.dtype
    on_device: bool  # on the accelerator (else on the CPU)


def _wire(dtype: torch.dtype) -> torch.dtype:
    return torch.uint8 if dtype == torch.bool else dtype  # bool travels as bytes


class BatchBroadcast:
    """Per group: the last layout seen, so a steady batch shape costs no pickling on the receivers."""

    def __init__(self, group, src: int, device: torch.device, cpu_group=None):
        self.group, self.src, self.device = group, src, device
        self.cpu_group = cpu_group if cpu_group is not None else group
        self.layout_bytes: bytes | None = None
        self.layout = None
        self.sending: list = []  # the source's broadcasts of the last batch: (work, tensor kept alive)

    def __call__(self, batch):
        src = dist.get_rank() == self.src
        if src:
            self.finish()
            tensors: list = []
            layout = apply_to_collection(batch, torch.Tensor, lambda t: self._slot(t, tensors))
            try:
                blob = pickle.dumps(layout)
            except Exception as err:
                raise TypeError(f"MegaStrategy sends each batch from rank {self.src} to the other tensor/pipeline "
                                f"ranks of its replica, and a non-tensor part of this batch cannot be pickled "
                                f"({err}). Return tensors, numbers, strings or containers of them from your "
                                f"collate_fn.") from err
            changed = blob != self.layout_bytes
            size = torch.tensor([len(blob) if changed else 0], dtype=torch.int64)
            self._broadcast(size, self.cpu_group, src)
            if changed:
                self._broadcast(torch.frombuffer(bytearray(blob), dtype=torch.uint8), self.cpu_group, src)
                self.layout_bytes = blob
            self.layout = layout
            self._move_tensors(tensors, src)
            return batch
        size = torch.zeros(1, dtype=torch.int64)
        self._broadcast(size, self.cpu_group, src)
        if size.item():
            blob = torch.empty(int(size.item()), dtype=torch.uint8)
            self._broadcast(blob, self.cpu_group, src)
            self.layout_bytes = blob.numpy().tobytes()
            self.layout = pickle.loads(self.layout_bytes)
        elif self.layout is None:
            raise RuntimeError("MegaStrategy batch broadcast: the first batch's layout never arrived.")
        return self._move_tensors(None, src)

    def _broadcast(self, tensor: torch.Tensor, group, src: bool) -> None:
        """The source starts it and keeps the tensor until :meth:`finish`; a receiver waits for it."""
        work = dist.broadcast(tensor, self.src, group=group, async_op=src)
        if src:
            self.sending.append((work, tensor))

    def finish(self) -> None:
        """Wait for the source's broadcasts still in flight (at its next batch: long landed by then)."""
        for work, _ in self.sending:
            work.wait()
        self.sending.clear()

    @staticmethod
    def _slot(t: torch.Tensor, tensors: list) -> _Slot:
        tensors.append(t)
        return _Slot(len(tensors) - 1, tuple(t.shape), t.dtype, t.device.type != "cpu")

    def _move_tensors(self, tensors, src: bool):
        slots: list = []
        apply_to_collection(self.layout, _Slot, slots.append)
        by_dtype: dict = {}
        for slot in slots:
            by_dtype.setdefault(_wire(slot.dtype), []).append(slot)
        out = {}
        for dtype, group in by_dtype.items():
            sizes = [torch.Size(s.shape).numel() for s in group]
            if src:
                flat = torch.cat([tensors[s.index].detach().to(self.device, dtype).reshape(-1) for s in group])
            else:
                flat = torch.empty(sum(sizes), dtype=dtype, device=self.device)
            if flat.numel():
                self._broadcast(flat, self.group, src)
            if src:
                continue
            for slot, piece in zip(group, flat.split(sizes)):
                t = piece.view(slot.shape)
                t = t.to(torch.bool) if slot.dtype == torch.bool else t
                out[slot.index] = t if slot.on_device else t.cpu()
        if src:
            return None
        return apply_to_collection(self.layout, _Slot, lambda s: out[s.index])
