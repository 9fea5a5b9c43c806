"""Dropless token dispatch for expert parallelism: tokens sorted by expert, exchanged with all-to-all so
each rank runs its own experts on every token routed to them, then sent back and combined with the
router weights. Works unchanged on one process (no exchange)."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import comm


class _AllToAll(torch.autograd.Function):
    """Rows of ``x`` split by ``send`` sizes to each rank, ``recv`` sizes received; backward: the reverse."""

    @staticmethod
    def forward(ctx, x, send: list, recv: list, group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _exchange(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def _exchange(x: torch.Tensor, send: list, recv: list, group) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
    comm.record("all_to_all", x, group)
    dist.all_to_all_single(out, x, output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


def all_to_all(x: torch.Tensor, send: list, recv: list, group) -> torch.Tensor:
    """Autograd-aware ``all_to_all_single`` over dim 0 with per-rank split sizes."""
    if comm.group_size(group) == 1:
        return x
    return _AllToAll.apply(x, list(send), list(recv), group)


@dataclass
class Dispatched:
    """What :func:`combine` needs to undo a :func:`dispatch`."""

    order: torch.Tensor  # (token, slot) pairs sorted by expert: their flat indices
    send: list  # rows sent to each ep rank
    recv: list  # rows received from each ep rank
    regroup: torch.Tensor | None  # received rows reordered from (source rank, expert) to (expert, source rank)
    tokens: int
    top_k: int


def capacity_of(capacity_factor: float, tokens: int, top_k: int, num_experts: int) -> int:
    """Rows an expert takes from one rank's tokens: ceil(factor x tokens x top_k / experts)."""
    return math.ceil(capacity_factor * tokens * top_k / num_experts)


def dispatch(x: torch.Tensor, expert_idx: torch.Tensor, num_experts: int, group=None, capacity: int | None = None):
    """``x`` [N, H], ``expert_idx`` [N, k] (global expert ids); ``capacity``: each expert keeps at most that
    many of this rank's (token, slot) pairs, earliest tokens first, the rest dropped. Returns (rows for this
    rank's experts grouped by local expert [M, H], rows per local expert, a :class:`Dispatched` for combine)."""
    ep = comm.group_size(group)
    n, k = expert_idx.shape
    local = num_experts // ep
    flat = expert_idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    if capacity is not None:  # position within its expert's run of the sorted pairs
        start = torch.cumsum(counts, 0) - counts
        kept = (torch.arange(order.numel(), device=order.device) - start[flat[order]]) < capacity
        order, counts = order[kept], counts.clamp(max=capacity)
    rows = x[order // k]
    if ep == 1:
        return rows, counts.tolist(), Dispatched(order, [rows.shape[0]], [rows.shape[0]], None, n, k)
    recv_counts = torch.empty_like(counts)
    comm.record("all_to_all_counts", counts, group)
    dist.all_to_all_single(recv_counts, counts, group=group)  # row s: what rank s sends to my experts
    counts, recv_counts = counts.view(ep, local), recv_counts.view(ep, local)
    send, recv = counts.sum(1).tolist(), recv_counts.sum(1).tolist()
    received = all_to_all(rows, send, recv, group)
    sizes = recv_counts.reshape(-1).tolist()  # one device-to-host read for every (source rank, expert) run
    starts = [0, *itertools.accumulate(sizes)]
    chunks = [torch.arange(starts[s * local + e], starts[s * local + e] + sizes[s * local + e])
              for e in range(local) for s in range(ep)]
    regroup = torch.cat(chunks).to(x.device) if chunks else torch.zeros(0, dtype=torch.long, device=x.device)
    return received[regroup], recv_counts.sum(0).tolist(), Dispatched(order, send, recv, regroup, n, k)


def combine(y: torch.Tensor, weights: torch.Tensor, d: Dispatched, group=None) -> torch.Tensor:
    """The experts' outputs ``y`` (as :func:`dispatch` grouped them) back to their tokens, each token's
    k outputs summed with its router ``weights`` [N, k] (a dropped pair adds nothing). Returns [N, H]."""
    if d.regroup is not None:
        y = torch.empty_like(y).index_copy(0, d.regroup, y)
        y = all_to_all(y, d.recv, d.send, group)
    flat = y.new_zeros((d.tokens * d.top_k,) + tuple(y.shape[1:])).index_copy(0, d.order, y)
    per_slot = flat.view(d.tokens, d.top_k, *y.shape[1:])
    return (per_slot * weights.to(y.dtype).unsqueeze(-1)).sum(1)
