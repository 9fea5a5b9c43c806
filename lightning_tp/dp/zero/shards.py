"""ZeRO-1's buckets: parameters viewed in one flat buffer per bucket; this dp rank steps the slices of them
that fall in its range (one ``nn.Parameter`` per parameter it touches, so a parameter without a gradient
is skipped as zero=0 skips it); gradients are reduce-scattered in, slices all-gathered back. See docs/zero.md."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ... import comm
from ..grads import counted

# elementwise optimizers: each element is stepped from its own gradient and state alone
ELEMENTWISE = ("SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "NAdam", "RAdam", "RMSprop", "Rprop", "ASGD")


def check_optimizer(optimizer) -> None:
    """A clear error for an optimizer that cannot step slices of parameters."""
    name = type(optimizer).__name__
    if name not in ELEMENTWISE:
        raise ValueError(f"MegaStrategy(zero=1) steps each data-parallel rank's slice of the parameters, so the "
                         f"optimizer must update every element from its own gradient and state alone (one of "
                         f"{', '.join(ELEMENTWISE)}); {name} is not known to (LBFGS needs the whole model, Adafactor "
                         f"factors 2-d states by row and column). Use zero=0 for it.")


class Slice:
    """This rank's part of one bucketed parameter: ``param`` (a 1-d view of the flat buffer, what the
    optimizer steps), its place in the bucket's slice (``where``) and in the parameter (``part``)."""

    def __init__(self, index: int, param: nn.Parameter, where: slice, part: slice, counted: torch.Tensor):
        self.index, self.param, self.where, self.part, self.counted = index, param, where, part, counted


class Bucket:
    """Parameters (one group, one dtype) viewed in one flat buffer padded to a multiple of dp (``group``'s
    size; an expert bucket's: the ranks holding its experts); ``slices``: the parts in this rank's range,
    each an ``nn.Parameter`` sharing the buffer's storage."""

    def __init__(self, params: list, group, dp: int, rank: int, tp_rank: int, pp_rank: int, expert: bool = False,
                 early: bool = False):
        numel = sum(p.numel() for p in params)
        self.size = -(-numel // dp)
        self.params, self.group, self.rank, self.expert = params, group, rank, expert
        self.early = early  # its gradients are final when the backward makes them (see .overlap)
        self.flat = torch.zeros(self.size * dp, dtype=params[0].dtype, device=params[0].device)
        self.offsets, at = [], 0
        for p in params:
            self.flat[at:at + p.numel()].copy_(p.detach().reshape(-1))
            p.data = self.flat[at:at + p.numel()].view_as(p)
            self.offsets.append(at)
            at += p.numel()
        lo, hi = rank * self.size, (rank + 1) * self.size
        self.slices = []
        for i, (p, at) in enumerate(zip(params, self.offsets)):
            start, end = max(at, lo), min(at + p.numel(), hi)
            if start < end:
                counted = _counted_mask(p, tp_rank, pp_rank).reshape(-1)[start - at:end - at].clone()
                piece = nn.Parameter(self.flat[start:end])
                piece._lightning_tp_zero = True  # a slice: its norm part comes from its optimizer (see grads)
                self.slices.append(Slice(i, piece, slice(start - lo, end - lo), slice(start - at, end - at), counted))
        # the reduce-scatter sends a (dp, size + flag_slots) buffer: row r is rank r's range of the gradients,
        # then one has-a-gradient flag per parameter in that range (summed: how many replicas had one)
        self.pieces = [list(_rows(at, p.numel(), self.size)) for p, at in zip(params, self.offsets)]
        self.rows = [[i for i, pieces in enumerate(self.pieces) if any(r == row for r, *_ in pieces)]
                     for row in range(dp)]
        self.flag_slots = max(len(r) for r in self.rows)
        self.tail = list(_rows(numel, self.size * dp - numel, self.size))  # the padding

    def reduce_scatter(self, scale: float) -> None:
        """The dp average of the parameters' gradients, this rank's slices into their ``grad`` (none for a
        parameter no replica had a gradient for); the parameters' own gradients are dropped."""
        self.finish_reduce_scatter(self.start_reduce_scatter(), scale)

    def start_reduce_scatter(self, drop: bool = False) -> tuple:
        """The parameters' gradients (zeros where one has none) and their flags reduce-scattered in the background;
        ``drop``: each parameter's ``grad`` dropped once copied (the buffer holds it, not two copies)."""
        dp = len(self.rows)
        buf = torch.empty(dp, self.size + self.flag_slots, dtype=self.flat.dtype, device=self.flat.device)
        flags = [[float(self.params[i].grad is not None) for i in row] + [0.0] * (self.flag_slots - len(row))
                 for row in self.rows]
        for p, pieces in zip(self.params, self.pieces):
            g = None if p.grad is None else p.grad.reshape(-1)
            for r, lo, hi, at in pieces:
                if g is None:
                    buf[r, at:at + hi - lo].zero_()
                else:
                    buf[r, at:at + hi - lo].copy_(g[lo:hi])
            if drop:
                p.grad = None
        for r, lo, hi, at in self.tail:
            buf[r, at:at + hi - lo].zero_()
        flags = torch.tensor(flags, dtype=buf.dtype)  # from pinned memory, without waiting for the device
        buf[:, self.size:].copy_(flags.pin_memory() if buf.is_cuda else flags, non_blocking=buf.is_cuda)
        comm.record("reduce_scatter", buf, self.group)
        if dist.get_backend(self.group) == "gloo":  # gloo's reduce-scatter all-reduces a copy of its input: the
            return dist.all_reduce(buf, group=self.group, async_op=True), buf  # same, in place (docs/zero.md)
        mine = torch.empty(self.size + self.flag_slots, dtype=buf.dtype, device=buf.device)
        return dist.reduce_scatter_tensor(mine, buf.view(-1), group=self.group, async_op=True), mine

    def finish_reduce_scatter(self, started: tuple, scale: float) -> None:
        """Wait for :meth:`start_reduce_scatter`, then as :meth:`reduce_scatter` says."""
        finish_reduce_scatters([self], [started], scale)

    def wait_reduce_scatter(self, started: tuple, scale: float) -> tuple:
        """Wait for :meth:`start_reduce_scatter`: (this rank's averaged gradients, its flags), on the device."""
        work, mine = started
        work.wait()
        if mine.dim() == 2:  # all-reduced in place: this rank's row; the buffer freed now (gloo's worker
            mine, whole = mine[self.rank].clone(), mine  # thread holds its last work's tensors until its next)
            whole.untyped_storage().resize_(0)
        return mine[:self.size].mul_(scale), mine[self.size:]

    def give_grads(self, grads: torch.Tensor, had: list) -> None:
        """Each slice its part of ``grads`` where its flag in ``had`` says a replica had one; the rest None."""
        for p in self.params:
            p.grad = None
        for k, s in enumerate(self.slices):  # this rank's slices are its row's parameters, in order
            s.param.grad = grads[s.where] if had[k] > 0 else None

    def all_gather(self, wait: bool = True):
        """Every rank's stepped slices back into the parameters (the flat buffer they view); ``wait=False``:
        started, its work returned."""
        comm.record("all_gather", self.flat, self.group)
        mine = self.flat[self.rank * self.size:(self.rank + 1) * self.size]  # in place, as NCCL and gloo allow
        work = dist.all_gather_into_tensor(self.flat, mine, group=self.group, async_op=True)
        return work.wait() if wait else work

    def gather(self, values: dict) -> torch.Tensor:
        """The whole flat tensor from each rank's slices' ``values`` (slice index -> 1-d tensor; zeros
        where a slice has none), on every rank."""
        mine = torch.zeros(self.size, dtype=torch.float32, device=self.flat.device)
        for s in self.slices:
            if id(s.param) in values:
                mine[s.where] = values[id(s.param)].float()
        out = torch.empty(self.size * comm.group_size(self.group), dtype=mine.dtype, device=mine.device)
        dist.all_gather_into_tensor(out, mine, group=self.group)
        return out


def _counted_mask(p, tp_rank: int, pp_rank: int) -> torch.Tensor:
    """True where an element of ``p`` counts in the global gradient norm on this rank (see grads.counted)."""
    mask = torch.zeros(p.shape, dtype=torch.bool, device=p.device)
    for piece in counted(p, mask, tp_rank, pp_rank):
        piece.fill_(True)
    return mask


def _rows(at: int, n: int, size: int):
    """Elements ``at .. at + n`` of a flat buffer cut at multiples of ``size``: (row, from, to, at in the row),
    ``from``/``to`` counted from ``at``."""
    done = 0
    while done < n:
        row, col = divmod(at + done, size)
        take = min(n - done, size - col)
        yield row, done, done + take, col
        done += take


def finish_reduce_scatters(buckets: list, started: list, scale: float) -> None:
    """Wait for each bucket's :meth:`Bucket.start_reduce_scatter` and give its slices their gradients; the
    flags of all buckets come to the host in one copy (one wait for the device, not one a bucket)."""
    parts = [b.wait_reduce_scatter(s, scale) for b, s in zip(buckets, started)]
    flags = torch.cat([f for _, f in parts]).tolist() if parts else []
    at = 0
    for b, (grads, f) in zip(buckets, parts):
        b.give_grads(grads, flags[at:at + len(f)])
        at += len(f)
