"""Where a rank's local tensor sits in the user's full one: a list of rectangular chunks (global offsets,
sizes and the local view holding them), read from the parameter's ShardSpec. Layout-free checkpoints
save and load these chunks under the single-device name (see docs/design/checkpoints-internals.md)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..layers.shard import ShardSpec


@dataclass
class Chunk:
    offsets: tuple  # in the full tensor
    view: torch.Tensor  # the local elements (a view of the rank's tensor)
    owner: bool = True  # False on a second holder of a replicated slice: it loads but does not write


@dataclass
class Chunked:
    """One full tensor's part on this rank."""
    shape: tuple  # the full tensor's shape
    chunks: list

    def at(self, offsets) -> torch.Tensor:
        offsets = tuple(offsets)
        for c in self.chunks:
            if c.offsets == offsets:
                return c.view
        raise KeyError(f"no chunk at {offsets}")


def full_shape(local: torch.Tensor, spec: ShardSpec | None) -> tuple:
    shape = list(local.shape)
    if spec is not None:
        shape[spec.dim] = spec.full
    return tuple(shape)


def chunks_of(local: torch.Tensor, spec: ShardSpec | None, rank: int) -> Chunked:
    """The chunks of the full tensor held by ``local`` on tensor-parallel ``rank`` (padding left out)."""
    if spec is None:
        return Chunked(tuple(local.shape), [Chunk((0,) * local.dim(), local)])
    sizes = spec.sections or [spec.full // spec.chunks] * spec.chunks
    out, start = [], 0
    for i, (piece, size) in enumerate(zip(spec.pieces(local, local=True), sizes)):
        step = piece.shape[spec.dim]
        offset = rank // spec.replica(i) * step
        valid = max(0, min(step, size - offset))  # the rest is padding (a vocabulary padded to tp)
        if valid:
            offsets = [0] * local.dim()
            offsets[spec.dim] = start + offset
            out.append(Chunk(tuple(offsets), piece.narrow(spec.dim, 0, valid), owner=rank % spec.replica(i) == 0))
        start += size
    return Chunked(full_shape(local, spec), out)
