"""One step's transfers behind one interface for the action loop (:func:`.loop.walk`): eager over the action
list's RECV and SEND actions (gloo), or one group per time slot (NCCL). See docs/design/pipeline-run.md.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

from ..transport.p2p import Mailbox, tag
from ..transport.p2p_slots import SlotMailbox


class Received(NamedTuple):
    """What a compute action was sent: the tensor, its grad split (see ..transport.messages) and the wait
    for its values (None: they are in)."""

    tensor: object
    split: tuple
    wait: object


class Ranks:
    """This rank's place in its pipeline, read through ``mesh`` (a later strategy may replace it): the virtual
    stage of each of its chunks and the global rank that runs any virtual stage."""

    def __init__(self, mesh, layout):
        self.mesh, self.pp, self.n_vstages = mesh, layout.pp, layout.pp * layout.v

    def rank_of(self, vstage: int) -> int:
        return self.mesh.global_rank(self.mesh.tp_rank, self.mesh.dp_rank, vstage % self.pp, self.mesh.cp_rank)

    def vstage(self, chunk: int) -> int:
        return chunk * self.pp + self.mesh.pp_rank

    def routes(self, forward_only: bool = False) -> "Routes":
        return Routes(self.rank_of, self.vstage, self.n_vstages, forward_only)


class Routes:
    """(peer rank, tag, channel) of a step's SEND and RECV actions; a forward-only step's (validate, test,
    predict) go on direction 2, apart from training's."""

    def __init__(self, rank_of, vstage_of, n_vstages: int, forward_only: bool = False):
        self.rank_of, self.vstage_of, self.n_vstages, self.forward_only = rank_of, vstage_of, n_vstages, forward_only

    def recv(self, a) -> tuple:
        """(src, tag, channel) of a RECV_F / RECV_B action."""
        k = self.vstage_of(a.chunk)
        d = 2 if self.forward_only else (0 if a.kind == "RECV_F" else 1)
        return self.rank_of(k + 1 if d == 1 else k - 1), tag(d, a.microbatch, k, self.n_vstages), (d, k)

    def send(self, a) -> tuple:
        """(dst, tag, channel) of a SEND_F / SEND_B action."""
        k = self.vstage_of(a.chunk)
        d, k = ((2 if self.forward_only else 0), k + 1) if a.kind == "SEND_F" else (1, k - 1)
        return self.rank_of(k), tag(d, a.microbatch, k, self.n_vstages), (d, k)

    def expected(self, actions) -> dict:
        """channel -> ordered [(tag, src)] of the receives in ``actions`` (a Mailbox posts them ahead)."""
        out = {}
        for a in actions:
            if a.kind in ("RECV_F", "RECV_B"):
                src, t, channel = self.recv(a)
                out.setdefault(channel, []).append((t, src))
        return out


class ListTransport:
    """Eager (gloo): the RECV before and the SEND after each compute action, through a Mailbox (receives posted
    ahead, sends released where a receive proves them landed); an F's activation is waited on at its stage's
    first block, and a SEND marked early leaves inside its compute action."""

    def __init__(self, plan, step, routes: Routes, box, device):
        self.plan, self.step, self.routes, self.box, self.device = plan, step, routes, box, device

    def receive(self, a) -> Received | None:
        """What compute action ``a`` is sent, its wait left to the stage's first block for an F."""
        recv = self.plan.receives.get(a)
        if recv is None:
            return None
        self.step.receiving(recv)
        src, t, channel = self.routes.recv(recv)
        tensor, work = self.box.recv(src, t, self.device, channel, wait=False)
        split = self.box.splits_in.get(channel, (0, 0))
        wait = partial(_arrive, work, self.box, self.plan.landed.get(recv, ()))
        if recv.kind == "RECV_B":
            wait()
            wait = None
        return Received(tensor, split, wait)

    def early(self, a):
        """The SEND made inside compute action ``a`` (where an F's run stops, as a B returns), or None."""
        send = self.plan.sends.get(a)
        return send if send is not None and send.early else None

    def send(self, send, value=None) -> None:
        """Make ``send`` now: ``value`` (what a run stops with), else what the step gives it."""
        self.box.send(self.step.payload(send) if value is None else value, *self.routes.send(send))

    def after(self, a) -> None:
        """The SEND after compute action ``a``, made at its turn unless made inside it (early)."""
        send = self.plan.sends.get(a)
        if send is None:
            return
        if not send.early:
            self.send(send)
        self.step.sent(send)

    def finish(self) -> None:
        self.box.wait()


class SlotTransport:
    """Batched (NCCL): one transfer group per time slot (see ..schedule.slots), a slot's after its compute
    action; what a compute action needs was received in an earlier slot's group."""

    def __init__(self, plan, step, routes: Routes, box):
        self.plan, self.step, self.routes, self.box = plan, step, routes, box
        self.slots, self.next = plan.slots, 0

    def receive(self, a) -> Received | None:
        """The groups of the slots without compute before ``a``'s, then what ``a`` is sent (waited on)."""
        while self.slots[self.next].compute is None:
            self._group(self.slots[self.next])
        recv = self.plan.receives.get(a)
        if recv is None:
            return None
        self.step.receiving(recv)
        _, t, channel = self.routes.recv(recv)
        tensor = self.box.take(channel, t)
        return Received(tensor, self.box.splits_in.get(channel, (0, 0)), None)

    def early(self, a) -> None:
        """Nothing leaves ahead of its slot."""
        return None

    def after(self, a) -> None:
        """The group of ``a``'s slot."""
        self._group(self.slots[self.next])

    def finish(self) -> None:
        while self.next < len(self.slots):
            self._group(self.slots[self.next])
        self.box.wait()

    def _group(self, slot) -> None:
        self.next += 1
        self.box.group([(self.step.payload(s), *self.routes.send(s)) for s in slot.sends],
                       [self.routes.recv(r) for r in slot.recvs])
        for s in slot.sends:
            self.step.sent(s)


def transport_for(plan, step, routes: Routes, device, remembered):
    """A step's transport: eager over its action list (``remembered``: the shapes guessed, or None), else one
    group per time slot (``remembered``: required, see ..transport.p2p_slots)."""
    if plan.slots is None:
        return ListTransport(plan, step, routes, Mailbox(plan.expected, device=device, remembered=remembered), device)
    return SlotTransport(plan, step, routes, SlotMailbox(remembered, device))


def _arrive(work, box, landed) -> None:
    """A receive's wait, then the release of the sends its arrival proves landed (see ..schedule.landed)."""
    work.wait()
    for sent in landed:
        box.release(sent)
