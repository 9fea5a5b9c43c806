"""Time slots: a schedule's transfers grouped one group per slot of a unit-time replay, so that
NCCL cannot deadlock on them. See docs/design/pipeline-schedules.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .schedules import Action, Schedule
from .simulate import simulate


@dataclass
class Slot:
    index: int  # the slot's time in the unit replay
    compute: Action | None = None
    sends: list = field(default_factory=list)  # SEND_F / SEND_B actions of this rank
    recvs: list = field(default_factory=list)  # RECV_F / RECV_B actions of this rank

    def __bool__(self) -> bool:
        return self.compute is not None or bool(self.sends) or bool(self.recvs)


def producer(a: Action, rank: int, p: int) -> tuple[int, Action]:
    """(rank, compute action) whose output a SEND or RECV action carries."""
    if a.kind in ("SEND_F", "SEND_B"):
        return rank, Action(a.kind[-1], a.microbatch, a.chunk)
    k = a.chunk * p + rank + (-1 if a.kind == "RECV_F" else 1)  # the virtual stage that sent it
    return k % p, Action(a.kind[-1], a.microbatch, k // p)


def slot_plan(schedule: Schedule, p: int, v: int = 1) -> list[list[Slot]]:
    """Per rank, its non-empty slots in order (see docs/design/pipeline-schedules.md)."""
    zero_bubble = any(a.kind == "W" for ops in schedule for a in ops)
    # unit times: F = B = 1 (and W = 1: simulate() takes B as the full backward, B - W where it is split; a
    # schedule splitting some backwards only, split_backward="drain", gives its whole ones 2 units: one
    # empty slot more, the same matching on both sides)
    result = simulate(schedule, p, v, {"F": 1, "B": 2, "W": 1} if zero_bubble else {"F": 1, "B": 1})
    start = {(r, a): int(s) for r, line in enumerate(result.timelines) for s, _, a in line}
    slots = [[Slot(t) for t in range(int(result.makespan))] for _ in range(p)]
    for r, ops in enumerate(schedule):
        for a in ops:
            if a.kind in ("F", "B", "W"):
                slots[r][start[(r, a)]].compute = a
                continue
            t = start[producer(a, r, p)]
            if a.kind.startswith("SEND"):
                slots[r][t].sends.append(a)
                continue
            consumer = Action(a.kind[-1], a.microbatch, a.chunk)
            if start[(r, consumer)] <= t:  # cannot happen for a schedule simulate() accepts
                raise ValueError(f"rank {r}: {consumer} would run in slot {start[(r, consumer)]}, before {a} "
                                 f"arrives in slot {t}")
            slots[r][t].recvs.append(a)
    return [[s for s in line if s] for line in slots]
