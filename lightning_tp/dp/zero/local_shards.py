"""A zero=3 (FSDP2) parameter, gradient or optimizer state is a DTensor sharded over dp: this rank's part
of it, and where that part lies in the whole (tp-local) tensor."""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor


def is_sharded(t) -> bool:
    """Whether ``t`` is a DTensor (an FSDP2-sharded parameter, its gradient or its optimizer state)."""
    return isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t`` (its local shard for a DTensor, ``t`` itself otherwise)."""
    return t.to_local() if is_sharded(t) else t


def local_range(t) -> tuple:
    """(first element, element count) of a DTensor's local shard in its flattened (tp-local) whole tensor."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    if not t.dim():
        return 0, 1
    return offset[0] * math.prod(t.shape[1:]), math.prod(shape)
