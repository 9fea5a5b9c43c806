"""Point-to-point transfers between pipeline stages: a header with a channel's first message of a step, tags
per message, receives posted ahead (with last step's shapes). See docs/design/pipeline-transport.md.
"""

from __future__ import annotations

import sys
from collections import deque

import torch
import torch.distributed as dist

from ... import comm

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool]
_DIMS = 8
HEADER = 2 + _DIMS + 2  # ndim, dtype code, up to 8 dims, then the grad split (see grad_split)


def grad_split(tensor: torch.Tensor) -> tuple:
    """(parts, numel) of a packed message whose parts only some need a gradient (see messages.pack):
    a bit per part that does, and how many leading values they fill; (0, 0) where the whole message's
    gradient comes back. Read before the send detaches the tensor (an attribute of the object)."""
    return getattr(tensor, "_lightning_tp_grad_split", (0, 0))


def header_of(tensor: torch.Tensor, split: tuple = (0, 0)) -> torch.Tensor:
    """The shape message: ndim, dtype code, dims, the grad split, as int64 on the tensor's device."""
    if tensor.dim() > _DIMS:
        raise ValueError(f"pipeline activations of {tensor.dim()} dims are not supported (max {_DIMS}).")
    shape = [tensor.dim(), _DTYPES.index(tensor.dtype), *tensor.shape]
    header = torch.tensor(shape + [0] * (HEADER - 2 - len(shape)) + list(split), dtype=torch.int64)
    if tensor.device.type == "cuda":  # pinned, so that the copy does not wait for the GPU to catch up
        header = header.pin_memory().to(tensor.device, non_blocking=True)
    return header


def shape_of(header: torch.Tensor) -> tuple:
    values = header.tolist()
    return tuple(values[2:2 + values[0]]), _DTYPES[values[1]]


def split_of(header: torch.Tensor) -> tuple:
    """The grad split a header carries (see grad_split)."""
    return tuple(header[-2:].tolist())


def checked_split(sent: dict, channel, split: tuple) -> None:
    """A channel's header goes with its first message of a step, so every microbatch after it must
    split its gradient alike (a part that requires grad in one and not the next is refused)."""
    first = sent.setdefault(channel, split)
    if first != split:
        raise ValueError(f"pipeline: the tensors a stage hands on need a gradient in one microbatch and not in "
                         f"another of the same step (parts {bin(first[0])} then {bin(split[0])}): every microbatch "
                         f"must run the same code.")


def first_message(tensor: torch.Tensor, channel, remembered: dict | None, split: tuple = (0, 0)) -> tuple:
    """A channel's first message of a step, as ``(now, after, old)``: lists of (tensor, tag offset) to send now
    and after the header, and the remembered shape ``old``. See docs/design/pipeline-transport.md."""
    new = (tuple(tensor.shape), tensor.dtype)
    old = None
    if remembered is not None:
        old, remembered["out"][channel] = remembered["out"].get(channel), new
    now = [(header_of(tensor, split), 0)]
    if old == new:
        return now + [(tensor, 1)], [], old
    if old is None:
        return now, [(tensor, 1)], old
    return now + [(torch.zeros(old[0], dtype=old[1], device=tensor.device), 1)], [(tensor, 2)], old


def release_landed(pending: deque) -> None:
    """Drop the oldest sends that completed (NCCL); gloo reports a send complete only once waited
    on, so there a sent tensor stays until :meth:`Mailbox.release` or the step's final wait. Entries
    are ``[work, tensor]``; one popped here is emptied too, as it may still be listed by tag."""
    while pending and (pending[0][0] is None or pending[0][0].is_completed()):
        entry = pending.popleft()
        entry[0] = entry[1] = None


def drop_sent_values(outputs: dict, key, inp) -> None:
    """Megatron's deallocate_output_tensor: once sent, a stage output's values are dropped (a one-element
    storage, expanded, keeps its shape for backward), unless something else may read them. See
    docs/design/pipeline-transport.md."""
    out = outputs[key]
    if type(out) is not torch.Tensor or out.grad_fn is None or out._base is not None or out.numel() <= 1:
        return
    if inp is not None and out.untyped_storage().data_ptr() == inp.untyped_storage().data_ptr():
        return
    held = {0: torch.empty(0)}
    probe = held[0]  # held as out is (a dict entry, a local): more references to out are someone else's
    if sys.getrefcount(out) > sys.getrefcount(probe):
        return
    out.data = torch.empty((1,), dtype=out.dtype, device=out.device).expand(out.shape)


def tag(direction: int, microbatch: int, vstage: int, n_vstages: int) -> int:
    """A message's tag; +1 and +2 are its payload's (+2 after a shape change, see Mailbox)."""
    return ((direction * 100_000 + microbatch) * n_vstages + vstage) * 4


class Mailbox:
    """Keeps in-flight sends alive until they land (see :mod:`..schedule.landed`) or step end, and posts a
    step's receives ahead (``expected``, ``remembered``: guessed shapes). See
    docs/design/pipeline-transport.md."""

    def __init__(self, expected: dict | None = None, depth: int = 2, batched: bool = False, device=None,
                 remembered: dict | None = None):
        self.pending = deque()  # [work, tensor] of sends in flight, oldest first ([None, None]: released)
        self.by_tag = {}  # a message's tag -> its entries in pending, until released
        self.sent, self.shapes = {}, {}  # per channel, for this step: messages sent, shape received
        self.splits_out, self.splits_in = {}, {}  # per channel, this step's grad split (see grad_split)
        self.batched = batched  # NCCL: no receive posted ahead (it would hold up the sends behind it)
        self.expected = {} if batched else {c: list(v) for c, v in (expected or {}).items()}
        self.posted, self.depth = {}, depth  # channel -> [(tag, work, buffer)] in order
        self.headers = {}  # channel -> (tag, work, buffer) of a header receive posted in advance
        self.remembered = None if batched or device is None else remembered
        self.guessed = {}  # channel -> ((shape, dtype), tags) of the payloads posted at open() as last step's
        self.stale_in = set()  # channels whose header said the shape changed: their guesses hold dummies
        self.stale_out = {}  # channel -> last step's (shape, dtype) where this step's differs (the sender's side)
        self.unconfirmed = {}  # channel -> FirstArrival of its first message, until waited on
        self.device, self.opened = device, False

    def open(self) -> None:
        """Post each channel's header (and guessed payloads) receives, at the step's first receive
        (:meth:`recv` calls it), not at step start. See docs/design/pipeline-transport.md."""
        if self.opened:
            return
        self.opened = True
        device = self.device
        if device is None:
            return
        for channel, ahead in self.expected.items():
            t, src = ahead[0]
            header = torch.empty(HEADER, dtype=torch.int64, device=device)
            self.headers[channel] = (t, dist.irecv(header, src, tag=t), header)
            guess = self.remembered["in"].get(channel) if self.remembered is not None else None
            if guess is not None:
                queue = self.posted.setdefault(channel, [])
                while ahead and len(queue) <= self.depth:
                    tg, src = ahead.pop(0)
                    out = torch.empty(guess[0], dtype=guess[1], device=device)
                    queue.append((tg, dist.irecv(out, src, tag=tg + 1), out))
                self.guessed[channel] = (guess, {tg for tg, _, _ in queue})

    def _isend(self, tensor, dst: int, t: int):
        return self._op(dist.isend, tensor, dst, t)

    def _irecv(self, buf, src: int, t: int):
        return self._op(dist.irecv, buf, src, t)

    def _op(self, op, tensor, peer: int, t: int):
        """Batched mode sends every transfer through batch_isend_irecv: on NCCL a plain isend/irecv
        runs on a communicator of its own (per rank pair) and never matches a batched one."""
        if self.batched:
            return dist.batch_isend_irecv([dist.P2POp(op, tensor, peer, tag=t)])[-1]
        return op(tensor, peer, tag=t)

    def send(self, tensor: torch.Tensor, dst: int, t: int, channel) -> None:
        split = grad_split(tensor)
        checked_split(self.splits_out, channel, split)
        tensor = tensor.detach().contiguous()
        comm.record("send", tensor, None)  # the payload only (not the header): counted like collectives
        release_landed(self.pending)
        j = self.sent[channel] = self.sent.get(channel, -1) + 1
        parts = [(tensor, 1)]
        if j == 0:
            parts = self._first_parts(tensor, channel, split)
        elif channel in self.stale_out and j <= self.depth:  # the receiver guessed last step's shape
            old = self.stale_out[channel]
            parts = [(torch.zeros(old[0], dtype=old[1], device=tensor.device), 1), (tensor, 2)]
        entries = [[self._isend(x, dst, t + offset), x] for x, offset in parts]  # no grouping: all leaves at once
        self.pending.extend(entries)
        self.by_tag[t] = entries

    def _first_parts(self, tensor, channel, split) -> list:
        """A channel's first message of a step (see first_message); its payload before its header
        where the receiver guessed its shape right (it reads the header last, see FirstArrival).
        Where it guessed wrong, the guesses of the ``depth`` messages after it get a dummy too (send)."""
        now, after, old = first_message(tensor, channel, self.remembered, split)
        if old is not None and after:
            self.stale_out[channel] = old
        return now + after if after else now[1:] + now[:1]

    def release(self, t: int) -> None:
        """Wait on the message sent with tag ``t``, known to have landed, and drop its tensors."""
        for entry in self.by_tag.pop(t, ()):
            if entry[0] is not None:
                entry[0].wait()
            entry[0] = entry[1] = None

    def _learn_shape(self, channel, header) -> None:
        self.shapes[channel] = shape_of(header)
        self.splits_in[channel] = split_of(header)
        if channel in self.guessed and self.guessed[channel][0] != self.shapes[channel]:
            self.stale_in.add(channel)
        if self.remembered is not None:
            self.remembered["in"][channel] = self.shapes[channel]

    def recv(self, src: int, t: int, device, channel, wait: bool = True):
        """The tensor received with tag ``t``; with ``wait=False``, (the tensor, its work) before its values
        are in: the caller waits before reading it. A channel's first message of a step is waited on
        here either way, for its shape, unless its payload was guessed (see FirstArrival)."""
        self.open()
        if channel in self.unconfirmed:  # a later message: its channel's first one's header first
            self.unconfirmed[channel].wait()
        if channel not in self.shapes:
            if self._hand_out_first(channel, t):
                _, header_work, header = self.headers.pop(channel)
                _, work, out = self.posted[channel].pop(0)
                self.splits_in[channel] = (0, 0)  # the whole message takes the gradient, until FirstArrival reads the header
                work = self.unconfirmed[channel] = FirstArrival(self, channel, src, t, device, header_work, header,
                                                                work, out)
                if not wait:
                    return out, work
                work.wait()
                return out
            if channel in self.headers and self.headers[channel][0] == t:
                _, work, header = self.headers.pop(channel)
            else:
                header = torch.empty(HEADER, dtype=torch.int64, device=device)
                work = self._irecv(header, src, t)
            work.wait()
            self._learn_shape(channel, header)
        queue = self.posted.setdefault(channel, [])
        if not queue or queue[0][0] != t:  # not foreseen: post it now
            queue.insert(0, self._post(channel, t, src, device))
        _, work, out = queue.pop(0)
        if channel in self.stale_in and t in self.guessed[channel][1]:  # the sender's dummy of last step's shape
            work.wait()
            _, work, out = self._post(channel, t, src, device, offset=2)
        ahead = self.expected.get(channel)
        if ahead and ahead[0][0] == t:  # posted unforeseen
            ahead.pop(0)
        self._post_ahead(channel, device)
        if not wait:
            return out, work
        work.wait()
        return out

    def _hand_out_first(self, channel, t) -> bool:
        """Whether a channel's first message, tag ``t``, is handed out as guessed (its header read on
        arrival): its payload and its header were posted at step start."""
        return channel in self.guessed and t in self.guessed[channel][1] and channel in self.headers \
            and self.headers[channel][0] == t

    def _post(self, channel, t, src, device, offset: int = 1):
        shape, dtype = self.shapes[channel]
        out = torch.empty(shape, dtype=dtype, device=device)
        return t, self._irecv(out, src, t + offset), out

    def _post_ahead(self, channel, device) -> None:
        ahead, queue = self.expected.get(channel, []), self.posted.setdefault(channel, [])
        while ahead and len(queue) < self.depth:
            queue.append(self._post(channel, *ahead.pop(0), device))

    def wait(self) -> None:
        for arrival in list(self.unconfirmed.values()):
            arrival.wait()
        leftover = [t for q in self.posted.values() for t, _, _ in q] + [t for t, _, _ in self.headers.values()]
        if leftover:
            raise RuntimeError(f"pipeline receives posted but never used (tags {leftover}): schedule mismatch.")
        for work, _ in self.pending:
            if work is not None:
                work.wait()
        self.pending.clear()
        self.by_tag.clear()


class FirstArrival:
    """The wait for a channel's first message of a step, handed out as guessed before its header is read; where
    the header says otherwise, the tensor handed out takes what it says. See
    docs/design/pipeline-transport.md."""

    def __init__(self, box, channel, src, t, device, header_work, header, work, out):
        self.box, self.channel, self.src, self.t, self.device = box, channel, src, t, device
        self.header_work, self.header, self.work, self.out = header_work, header, work, out
        self.done = False

    def wait(self) -> None:
        if self.done:
            return
        self.done = True
        box, channel = self.box, self.channel
        box.unconfirmed.pop(channel, None)
        self.header_work.wait()
        box._learn_shape(channel, self.header)
        self.work.wait()
        whole = self.out
        if channel in box.stale_in:
            _, work, whole = box._post(channel, self.t, self.src, self.device, offset=2)
            work.wait()
        parts, numel = box.splits_in[channel]
        if parts:
            whole = whole.detach()
            self.out.data = whole[:numel]
            self.out._lightning_tp_whole = (whole, parts)
        elif whole is not self.out:
            self.out.data = whole
        box._post_ahead(channel, self.device)
