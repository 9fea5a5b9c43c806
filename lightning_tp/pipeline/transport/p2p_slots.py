"""Transfers one group per time slot (see :mod:`..schedule.slots`): what NCCL needs, also run on gloo. Each
slot's sends and receives leave in one ``batch_isend_irecv``. See docs/design/pipeline-transport.md.
"""

from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist

from ... import comm
from .p2p import HEADER, checked_split, first_message, grad_split, release_landed, shape_of, split_of


class SlotMailbox:
    """One training step's transfers; ``remembered`` ({"in": {}, "out": {}}) is the caller's across steps."""

    def __init__(self, remembered: dict, device):
        self.remembered, self.device = remembered, device
        self.shapes, self.sent_first = {}, set()  # per channel, this step
        self.splits_out, self.splits_in = {}, {}  # per channel, this step's grad split (see p2p.grad_split)
        self.arrived = {}  # (channel, tag) -> [work, buffer] of a posted payload
        self.unissued = {}  # id(buffer) -> its entry in arrived, until its group is issued
        self.keep = deque()  # sends in flight [work, tensor], oldest first

    def group(self, sends: list, recvs: list) -> None:
        """Issue one slot: ``sends`` [(tensor, dst, tag, channel)], ``recvs`` [(src, tag, channel)]."""
        release_landed(self.keep)
        ops, later, headers = [], [], []
        for tensor, dst, t, channel in sends:
            split = grad_split(tensor)
            checked_split(self.splits_out, channel, split)
            tensor = tensor.detach().contiguous()
            comm.record("send", tensor, None)
            if channel in self.sent_first:
                if (tuple(tensor.shape), tensor.dtype) != self.remembered["out"][channel]:  # NCCL would corrupt
                    raise ValueError(f"pipeline stage output {tuple(tensor.shape)} {tensor.dtype} differs from an "
                                     f"earlier microbatch's {self.remembered['out'][channel]} in the same step: "
                                     f"every microbatch must give the same shapes.")
                ops.append((dist.isend, tensor, dst, t + 1))
                continue
            self.sent_first.add(channel)
            now, after, _ = first_message(tensor, channel, self.remembered, split)
            ops += [(dist.isend, x, dst, t + offset) for x, offset in now]
            later += [(dist.isend, x, dst, t + offset) for x, offset in after]
        for src, t, channel in recvs:
            if channel in self.shapes:
                ops.append(self._payload(channel, src, t, t + 1))
                continue
            header = torch.empty(HEADER, dtype=torch.int64, device=self.device)
            ops.append((dist.irecv, header, src, t))
            guess = self.remembered["in"].get(channel)
            if guess is not None:
                self.shapes[channel] = guess
                ops.append(self._payload(channel, src, t, t + 1))
            headers.append((len(ops) - (2 if guess else 1), src, t, channel, guess))
        works = self._issue(ops)
        for i, src, t, channel, guess in headers:  # the CPU waits for this slot here (reads the headers)
            works[i].wait()
            shape, self.splits_in[channel] = shape_of(ops[i][1]), split_of(ops[i][1])
            self.shapes[channel] = self.remembered["in"][channel] = shape
            if guess is None:  # the payload follows the header (see first_message)
                later.append(self._payload(channel, src, t, t + 1))
            elif guess != shape:  # the dummy came instead: wait for it, the payload comes on t + 2
                self.arrived.pop((channel, t))[0].wait()
                later.append(self._payload(channel, src, t, t + 2))
        self._issue(later)

    def _payload(self, channel, src, t, wire_tag):
        shape, dtype = self.shapes[channel]
        buffer = torch.empty(shape, dtype=dtype, device=self.device)
        self.arrived[(channel, t)] = self.unissued[id(buffer)] = [None, buffer]  # work: set by _issue
        return dist.irecv, buffer, src, wire_tag

    def _issue(self, ops: list) -> list:
        """One ``batch_isend_irecv``; returns a work per op (NCCL returns one for the whole group)."""
        if not ops:
            return []
        works = dist.batch_isend_irecv([dist.P2POp(op, x, peer, tag=t) for op, x, peer, t in ops])
        works = works if len(works) == len(ops) else [works[-1]] * len(ops)
        for (op, x, _, _), work in zip(ops, works):
            if op is dist.isend:  # a receive's work is waited on exactly once (gloo: a second wait hangs)
                self.keep.append([work, x])
            elif id(x) in self.unissued:
                self.unissued.pop(id(x))[0] = work
        return works

    def take(self, channel, t: int) -> torch.Tensor:
        """The payload received on ``channel`` with tag ``t`` (posted in an earlier slot)."""
        work, buffer = self.arrived.pop((channel, t))
        work.wait()
        return buffer

    def wait(self) -> None:
        if self.arrived:
            raise RuntimeError(f"pipeline receives posted but never used ({sorted(self.arrived)}): schedule mismatch.")
        for work, _ in self.keep:
            work.wait()
        self.keep.clear()
