"""How a local parameter relates to the user's full one (:class:`ShardSpec`), so it can be cut now and
rebuilt exactly later (:func:`unshard`). See docs/design/tensor-parallel.md."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from ..marks import marks_of, set_marks


@dataclass(frozen=True)
class ShardSpec:
    dim: int
    world: int
    full: int  # size of `dim` in the user's tensor (all chunks, no padding)
    chunks: int = 1
    padded: int = 0  # size of `dim` after padding (0: no padding)
    sections: tuple = ()  # unequal piece sizes (overrides chunks)
    replicas: tuple = ()  # per piece: ranks holding the same slice (1 each when empty)
    at_rank: int = -1  # >= 0: the slice held whatever the tp rank (an expert-parallel rank's experts)
    inner: "ShardSpec | None" = None  # a second sharded dimension, cut by the tp rank (an expert's width under etp)

    def rank(self, tp_rank: int) -> int:
        """The slice a tensor on tensor-parallel ``tp_rank`` holds."""
        return self.at_rank if self.at_rank >= 0 else tp_rank

    def replica(self, i: int) -> int:
        return self.replicas[i] if self.replicas else 1

    def slices(self, i: int) -> int:
        """Distinct slices piece i is cut into."""
        return self.world // self.replica(i)

    def pieces(self, t: torch.Tensor, local: bool = False) -> tuple:
        """The pieces of a full tensor, or (``local``) of one rank's shard."""
        if self.sections:
            return t.split([s // (self.slices(i) if local else 1) for i, s in enumerate(self.sections)],
                           dim=self.dim)
        return t.chunk(self.chunks, dim=self.dim) if self.chunks > 1 else (t,)

    def as_dict(self) -> dict:
        return asdict(self)

    def __post_init__(self):
        object.__setattr__(self, "sections", tuple(self.sections))
        object.__setattr__(self, "replicas", tuple(self.replicas))
        if self.replicas and not self.sections and len(set(self.replicas)) > 1:
            raise ValueError(f"equal chunks must share one replica count, got {self.replicas}.")
        if any(self.world % k for k in self.replicas):
            raise ValueError(f"replicas {self.replicas} must divide world = {self.world}.")


def shard(full: torch.Tensor, spec: ShardSpec, rank: int) -> torch.Tensor:
    """Tensor-parallel ``rank``'s part of ``full`` (both dimensions of a spec with an ``inner`` one)."""
    out = _shard_dim(full, spec, rank)
    return out if spec.inner is None else _shard_dim(out, spec.inner, rank)


def _shard_dim(full: torch.Tensor, spec: ShardSpec, rank: int) -> torch.Tensor:
    out, rank = [], spec.rank(rank)
    for i, piece in enumerate(spec.pieces(full)):
        size = piece.shape[spec.dim]
        target = spec.padded // spec.chunks if spec.padded else size
        if target > size:
            pad_shape = list(piece.shape)
            pad_shape[spec.dim] = target - size
            piece = torch.cat([piece, piece.new_zeros(pad_shape)], dim=spec.dim)
        step = target // spec.slices(i)
        out.append(piece.narrow(spec.dim, rank // spec.replica(i) * step, step))
    return out[0].clone() if len(out) == 1 else torch.cat(out, dim=spec.dim)


def unshard(locals_by_rank: list[torch.Tensor], spec: ShardSpec) -> torch.Tensor:
    per_rank = [spec.pieces(t, local=True) for t in locals_by_rank]
    sizes = spec.sections or [spec.full // spec.chunks] * spec.chunks
    pieces = []
    for c, size in enumerate(sizes):
        holders = range(0, spec.world, spec.replica(c))  # a replicated slice is taken once
        piece = torch.cat([per_rank[r][c] for r in holders], dim=spec.dim)
        pieces.append(piece.narrow(spec.dim, 0, size))
    return torch.cat(pieces, dim=spec.dim)


def padded_size(size: int, world: int) -> int:
    return -(-size // world) * world


def mark(param: torch.nn.Parameter, spec: ShardSpec | None = None, sp_partial: bool = False):
    """Tag a parameter: sharded (spec) or replicated; sp_partial means its grad is a per-rank partial sum."""
    if spec is not None:
        set_marks(param, tp_spec=spec)
    if sp_partial:
        set_marks(param, sp_partial=True)
    return param


def spec_of(param) -> ShardSpec | None:
    return marks_of(param).tp_spec


def check_divisible(what: str, module_name: str, size: int, tp: int, hint: str) -> None:
    if size % tp:
        raise ValueError(
            f"{module_name}: {what} = {size} is not divisible by tp = {tp}. {hint}"
        )
