"""Point-to-point transfers between pipeline stages.

Each message is a small header (shape and dtype) followed by the tensor, so a receiver needs no
shape guesses. Tags name the message (direction, microbatch, receiving virtual stage): a rank that
runs several chunks gets each tensor where it belongs, whatever order the transfers land in.
Sends are non-blocking; receives block, which is what the schedules' deadlock check assumes.
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

    def send(self, tensor: torch.Tensor, dst: int, t: int) -> None:
        tensor = tensor.detach().contiguous()
        if tensor.dim() > _HEADER - 2:
            raise ValueError(f"pipeline activations of {tensor.dim()} dims are not supported (max {_HEADER - 2}).")
        header = torch.zeros(_HEADER, dtype=torch.int64, device=tensor.device)
        header[0], header[1] = tensor.dim(), _DTYPES.index(tensor.dtype)
        header[2:2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
        comm._record("send", tensor, None)  # the payload only (not the header): counted like collectives
        self.pending = [(w, t) for w, t in self.pending if not w.is_completed()]  # free what has landed
        self.pending.append((dist.isend(header, dst, tag=t), header))
        self.pending.append((dist.isend(tensor, dst, tag=t + 1), tensor))

    @staticmethod
    def recv(src: int, t: int, device) -> torch.Tensor:
        header = torch.empty(_HEADER, dtype=torch.int64, device=device)
        dist.irecv(header, src, tag=t).wait()
        ndim, code = int(header[0]), int(header[1])
        out = torch.empty(tuple(header[2:2 + ndim].tolist()), dtype=_DTYPES[code], device=device)
        dist.irecv(out, src, tag=t + 1).wait()
        return out

    def wait(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()
