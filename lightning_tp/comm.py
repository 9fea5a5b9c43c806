"""Collectives of the tensor-parallel region, each an autograd Function with its backward twin (Megatron's
mappings), all through primitives that :func:`count_collectives` can record. See docs/design/tensor-parallel.md."""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.distributed as dist

_RECORDS: Optional[list] = None


@contextlib.contextmanager
def count_collectives():
    """Record ``(op, numel, group)`` for every collective issued inside the block."""
    global _RECORDS
    previous, _RECORDS = _RECORDS, []
    try:
        yield _RECORDS
    finally:
        _RECORDS = previous


def group_size(group) -> int:
    if group is None or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def group_rank(group) -> int:
    if group is None or not dist.is_initialized():
        return 0
    return dist.get_rank(group)


def record(op: str, t: torch.Tensor, group) -> None:
    if _RECORDS is not None:
        _RECORDS.append((op, t.numel(), group))


# ---------------------------------------------------------------- primitives (no autograd)


def all_reduce(t: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In place when ``t`` is contiguous; returns the reduced tensor either way."""
    if group_size(group) == 1:
        return t
    t = t.contiguous()
    record("all_reduce", t, group)
    dist.all_reduce(t, op=op, group=group)
    return t


def _op(name: str, before: str):
    """torch.distributed's ``name`` (torch 2.13), or its earlier name ``before`` (torch 2.11 has only that)."""
    return getattr(dist, name, None) or getattr(dist, before)


def all_gather(t: torch.Tensor, dim: int, group) -> torch.Tensor:
    world = group_size(group)
    if world == 1:
        return t
    x = t.movedim(dim, 0).contiguous()
    out = x.new_empty((world * x.shape[0],) + tuple(x.shape[1:]))
    record("all_gather", x, group)
    _op("all_gather_single", "all_gather_into_tensor")(out, x, group=group)
    return out.movedim(0, dim).contiguous()


def reduce_scatter(t: torch.Tensor, dim: int, group) -> torch.Tensor:
    world = group_size(group)
    if world == 1:
        return t
    size = t.shape[dim]
    if size % world:
        raise ValueError(
            f"sequence parallelism splits dimension {dim} of size {size} over tp={world}: it must be divisible. "
            f"Use a sequence length that is a multiple of {world}, or sp=False."
        )
    x = t.movedim(dim, 0).contiguous()
    out = x.new_empty((x.shape[0] // world,) + tuple(x.shape[1:]))
    record("reduce_scatter", x, group)
    _op("reduce_scatter_single", "reduce_scatter_tensor")(out, x, group=group)
    return out.movedim(0, dim).contiguous()


def split(t: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This rank's contiguous slice along ``dim`` (no communication)."""
    world = group_size(group)
    if world == 1:
        return t
    size = t.shape[dim]
    if size % world:
        raise ValueError(
            f"cannot split dimension {dim} of size {size} evenly over {world} tensor-parallel ranks; "
            f"make it a multiple of {world}."
        )
    return t.narrow(dim, group_rank(group) * (size // world), size // world).contiguous()


def row_range(total: int, world: int, rank: int) -> tuple:
    """(start, count) of ``rank``'s rows when ``total`` rows are split as evenly as they go over ``world``."""
    base, extra = divmod(total, world)
    return rank * base + min(rank, extra), base + (rank < extra)


def split_rows(t: torch.Tensor, group) -> torch.Tensor:
    """This rank's rows of ``t`` (dim 0, uneven counts allowed: the first ranks take one more)."""
    world = group_size(group)
    return t if world == 1 else t.narrow(0, *row_range(t.shape[0], world, group_rank(group))).contiguous()


def gather_rows(t: torch.Tensor, total: int, group) -> torch.Tensor:
    """Every rank's rows of a ``total``-row tensor split by :func:`split_rows`, back in order (all-gather)."""
    world = group_size(group)
    if world == 1:
        return t
    width = -(-total // world)
    padded = torch.cat([t, t.new_zeros((width - t.shape[0],) + tuple(t.shape[1:]))]) if t.shape[0] < width else t
    full = all_gather(padded, 0, group)
    return torch.cat([full.narrow(0, r * width, row_range(total, world, r)[1]) for r in range(world)])


# ---------------------------------------------------------------- autograd twins


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return all_reduce(g.clone(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, g):
        return split(g, ctx.dim, ctx.group), None, None


class _Split(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return split(x, dim, group)

    @staticmethod
    def backward(ctx, g):
        return all_gather(g, ctx.dim, ctx.group), None, None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, g):
        return reduce_scatter(g, ctx.dim, ctx.group), None, None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx, g):
        return all_gather(g, ctx.dim, ctx.group), None, None


class _SplitRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.total, ctx.group = x.shape[0], group
        return split_rows(x, group)

    @staticmethod
    def backward(ctx, g):
        return gather_rows(g, ctx.total, ctx.group), None


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, total, group):
        ctx.group = group
        return gather_rows(x, total, group)

    @staticmethod
    def backward(ctx, g):
        return split_rows(g, ctx.group), None, None


def _active(group) -> bool:
    return group_size(group) > 1


def copy_to_tp(x, group):
    return _CopyToTP.apply(x, group) if _active(group) else x


def reduce_from_tp(x, group):
    return _ReduceFromTP.apply(x, group) if _active(group) else x


def gather_from_tp(x, group, dim: int = -1):
    return _GatherFromTP.apply(x, dim, group) if _active(group) else x


def scatter_to_tp(x, group, dim: int = -1):
    return _Split.apply(x, dim, group) if _active(group) else x


def scatter_to_sp(x, group, dim: int = 1):
    return _Split.apply(x, dim, group) if _active(group) else x


def gather_to_full_sp(x, group, dim: int = 1):
    """Leave the SP region for a replicated consumer: each rank's grad is the full-sequence grad."""
    return _GatherFromTP.apply(x, dim, group) if _active(group) else x


def gather_from_sp(x, group, dim: int = 1):
    return _GatherFromSP.apply(x, dim, group) if _active(group) else x


def reduce_scatter_to_sp(x, group, dim: int = 1):
    return _ReduceScatterToSP.apply(x, dim, group) if _active(group) else x


def scatter_to_rows(x, group):
    """A replicated input's rows split over ``group`` (uneven allowed); backward: the full gradient again."""
    return _SplitRows.apply(x, group) if _active(group) else x


def gather_from_rows(x, total: int, group):
    """Rows split by :func:`scatter_to_rows` back whole on every rank; backward: this rank's rows."""
    return _GatherRows.apply(x, total, group) if _active(group) else x
