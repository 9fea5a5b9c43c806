"""Where a rank's local tensor sits in the user's full one: a list of rectangular chunks (global offsets,
sizes and the local view holding them), read from the parameter's ShardSpec. Layout-free checkpoints
save and load these chunks under the single-device name (see docs/design/checkpoints-internals.md)."""

from __future__ import annotations

import math
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
    return _full(tuple(local.shape), spec)


def _full(shape: tuple, spec: ShardSpec | None) -> tuple:
    shape = list(shape)
    while spec is not None:  # a spec and its inner one
        shape[spec.dim], spec = spec.full, spec.inner
    return tuple(shape)


def _pieces(shape, spec: ShardSpec | None, rank: int) -> list:
    """(local start, length, full start, owner) along ``spec.dim`` of each piece of the full tensor a local
    tensor of ``shape`` holds on tensor-parallel ``rank`` (padding left out)."""
    if spec is None:
        return []
    rank = spec.rank(rank)
    sizes = spec.sections or [spec.full // spec.chunks] * spec.chunks
    local = [s // spec.slices(i) for i, s in enumerate(sizes)] if spec.sections else \
        [shape[spec.dim] // spec.chunks] * spec.chunks
    out, start, at = [], 0, 0
    for i, (size, step) in enumerate(zip(sizes, local)):
        offset = rank // spec.replica(i) * step
        valid = max(0, min(step, size - offset))  # the rest is padding (a vocabulary padded to tp)
        if valid:
            out.append((at, valid, start + offset, rank % spec.replica(i) == 0))
        start, at = start + size, at + step
    return out


def _placed(offsets: tuple, view: torch.Tensor, spec, pieces: list, inner: list = ()) -> list:
    """The chunks of the full tensor a local block (its local ``offsets``, its values ``view``) covers;
    ``inner``: the pieces along ``spec.inner``'s dimension, placed in each chunk after ``spec``'s."""
    if spec is None:
        return [Chunk(tuple(offsets), view)]
    d, lo = spec.dim, offsets[spec.dim]
    out = []
    for at, valid, full_at, owner in pieces:
        a, b = max(lo, at), min(lo + view.shape[d], at + valid)
        if a < b:
            placed = list(offsets)
            placed[d] = full_at + a - at
            out.append(Chunk(tuple(placed), view.narrow(d, a - lo, b - a), owner))
    if spec.inner is None:
        return out
    k = spec.inner.dim  # still local in each chunk: place it along the inner dimension too
    return [Chunk(c.offsets[:k] + p.offsets[k:k + 1] + c.offsets[k + 1:], p.view, c.owner and p.owner)
            for c in out for p in _placed(tuple(offsets), c.view, spec.inner, inner)]


def _inner_pieces(shape, spec: ShardSpec | None, rank: int) -> list:
    return _pieces(shape, spec.inner, rank) if spec is not None and spec.inner is not None else []


def chunks_of(local: torch.Tensor, spec: ShardSpec | None, rank: int) -> Chunked:
    """The chunks of the full tensor held by ``local`` on tensor-parallel ``rank``."""
    return Chunked(full_shape(local, spec), _placed((0,) * local.dim(), local, spec, _pieces(local.shape, spec, rank),
                                                    _inner_pieces(local.shape, spec, rank)))


def _blocks(shape: tuple, start: int, end: int) -> list:
    """Elements [start, end) of a C-ordered tensor of ``shape`` as blocks (offsets, sizes), in order."""
    if start >= end:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    (r0, c0), (r1, c1) = divmod(start, inner), divmod(end, inner)
    row = lambda r, a, b: [((r,) + o, (1,) + z) for o, z in _blocks(shape[1:], a, b)]  # noqa: E731
    if r0 == r1:
        return row(r0, c0, c1)
    out = row(r0, c0, inner) if c0 else []
    r0 += bool(c0)
    if r1 > r0:
        out.append(((r0,) + (0,) * (len(shape) - 1), (r1 - r0,) + tuple(shape[1:])))
    return out + (row(r1, 0, c1) if c1 else [])


def flat_chunks_of(values: torch.Tensor, shape: tuple, spec: ShardSpec | None, rank: int, start: int) -> Chunked:
    """The chunks of the full tensor covered by ``values``: elements ``start``... of the (flattened) local
    tensor of ``shape`` on tensor-parallel ``rank`` (a ZeRO slice's state)."""
    pieces, inner, out, at = _pieces(shape, spec, rank), _inner_pieces(shape, spec, rank), [], 0
    for offsets, sizes in _blocks(tuple(shape), start, start + values.numel()):
        n = math.prod(sizes)
        out += _placed(offsets, values[at:at + n].view(sizes), spec, pieces, inner)
        at += n
    return Chunked(_full(tuple(shape), spec), out)
