"""Point-to-point transfers between pipeline stages.

The first message of a step on a channel (direction, receiving virtual stage) carries a small
header (shape and dtype); the microbatches after it have the same shape, so they travel alone.
Both sides walk a channel's microbatches in increasing order (every schedule does), so they agree
on which message is first. Tags name each message (direction, microbatch, receiving virtual
stage): a rank that runs several chunks gets each tensor where it belongs. Sends are
non-blocking; receives block, which is what the schedules' deadlock check assumes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import comm

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool]
_HEADER = 10  # ndim, dtype code, up to 8 dims


def tag(direction: int, microbatch: int, vstage: int, n_vstages: int) -> int:
    return ((direction * 100_000 + microbatch) * n_vstages + vstage) * 2


class Mailbox:
    """Keeps in-flight sends alive until they complete (checked at each send, waited at step end)."""

    def __init__(self):
        self.pending = []
        self.sent_header, self.shapes = set(), {}  # per channel, for this step

    def send(self, tensor: torch.Tensor, dst: int, t: int, channel) -> None:
        tensor = tensor.detach().contiguous()
        if tensor.dim() > _HEADER - 2:
            raise ValueError(f"pipeline activations of {tensor.dim()} dims are not supported (max {_HEADER - 2}).")
        header = torch.zeros(_HEADER, dtype=torch.int64, device=tensor.device)
        header[0], header[1] = tensor.dim(), _DTYPES.index(tensor.dtype)
        header[2:2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
        comm._record("send", tensor, None)  # the payload only (not the header): counted like collectives
        self.pending = [(w, x) for w, x in self.pending if not w.is_completed()]  # free what has landed
        if channel not in self.sent_header:
            self.sent_header.add(channel)
            self.pending.append((dist.isend(header, dst, tag=t), header))
        self.pending.append((dist.isend(tensor, dst, tag=t + 1), tensor))

    def recv(self, src: int, t: int, device, channel) -> torch.Tensor:
        if channel not in self.shapes:
            header = torch.empty(_HEADER, dtype=torch.int64, device=device)
            dist.irecv(header, src, tag=t).wait()
            ndim = int(header[0])
            self.shapes[channel] = (tuple(header[2:2 + ndim].tolist()), _DTYPES[int(header[1])])
        shape, dtype = self.shapes[channel]
        out = torch.empty(shape, dtype=dtype, device=device)
        dist.irecv(out, src, tag=t + 1).wait()
        return out

    def wait(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()
