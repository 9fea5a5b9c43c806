"""Discrete-event replay of a pipeline schedule, without processes: checks it (malformed, deadlock)
and measures makespan, bubbles and activations in flight. ``cost["B"]`` is the full backward;
see docs/design/pipeline-schedules.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from numbers import Real

from .schedules import Action, Schedule, message, split_keys

DEFAULT_COST = {"F": 1, "B": 2, "W": 1}


class ScheduleError(ValueError):
    """The schedule is malformed (missing dependency, duplicate, bad peer)."""


class DeadlockError(ScheduleError):
    """Every unfinished rank is blocked on a RECV whose SEND never runs."""


@dataclass
class SimResult:
    makespan: Real
    busy: list[Real]
    peak_inflight: list[int]
    # per rank: (start, end, action) for each compute action, in order
    timelines: list[list[tuple[Real, Real, Action]]] = field(repr=False)

    @property
    def idle(self) -> list[Real]:
        """Per-rank bubble time: time inside the makespan spent not computing."""
        return [self.makespan - b for b in self.busy]

    @property
    def rank_bubble_fraction(self) -> list[float]:
        return [float(i / self.makespan) if self.makespan else 0.0 for i in self.idle]

    @property
    def bubble_fraction(self) -> float:
        """Idle share of all ranks' time: 1 - sum(busy) / (p * makespan)."""
        if not self.makespan:
            return 0.0
        return float(sum(self.idle) / (len(self.busy) * self.makespan))


class _Rank:
    def __init__(self, rank: int, actions: list[Action]) -> None:
        self.rank, self.actions = rank, actions
        self.pc = 0
        self.clock: Real = 0
        self.busy: Real = 0
        self.done: set[tuple[str, int, int]] = set()  # (kind, mb, chunk) incl. RECVs
        self.inflight = 0
        self.peak = 0
        self.timeline: list[tuple[Real, Real, Action]] = []


def simulate(schedule: Schedule, p: int, v: int = 1, cost: dict | None = None) -> SimResult:
    """Replay ``schedule`` on p ranks with v chunks each (cost convention: docs/design/pipeline-schedules.md)."""
    if len(schedule) != p:
        raise ScheduleError(f"schedule has {len(schedule)} rank lists, expected p={p}")
    cost = {**DEFAULT_COST, **(cost or {})}
    has_w = any(a.kind == "W" for ops in schedule for a in ops)
    split = [split_keys(ops) for ops in schedule]  # per rank: the B's that are input halves
    duration = {
        "F": cost["F"],
        "B": cost["B"],
        "B_input": cost["B"] - cost["W"],
        "W": cost["W"],
    }
    if has_w and any(d < 0 for d in duration.values()):
        raise ValueError(f"negative action cost from {cost} (B must cover W in ZB)")
    last = p * v - 1
    sent: dict[tuple[str, int, int], Real] = {}  # (direction, mb, dest vstage) -> time
    consumed: set[tuple[str, int, int]] = set()
    ranks = [_Rank(r, list(ops)) for r, ops in enumerate(schedule)]

    def fail(r: _Rank, a: Action, why: str) -> None:
        raise ScheduleError(f"rank {r.rank} action #{r.pc} {a}: {why}")

    def step(r: _Rank, a: Action) -> bool:
        """Run one action; False means blocked on a RECV."""
        if a.chunk >= v:
            fail(r, a, f"chunk out of range for v={v}")
        k = a.chunk * p + r.rank
        key = (a.kind, a.microbatch, a.chunk)
        if key in r.done:
            fail(r, a, "duplicate action")
        if a.kind in ("SEND_F", "SEND_B"):
            fwd = a.kind == "SEND_F"
            tkey = message(a, r.rank, p)
            if not 0 <= tkey[2] <= last:
                fail(r, a, f"virtual stage {k} has no {'next' if fwd else 'previous'} stage")
            if ("F" if fwd else "B", a.microbatch, a.chunk) not in r.done:
                fail(r, a, "sends a result that has not been computed yet")
            sent[tkey] = r.clock
        elif a.kind in ("RECV_F", "RECV_B"):
            if (a.kind == "RECV_F" and k == 0) or (a.kind == "RECV_B" and k == last):
                fail(r, a, f"virtual stage {k} has no peer to receive from")
            tkey = message(a, r.rank, p)
            if tkey not in sent:
                return False
            consumed.add(tkey)
            r.clock = max(r.clock, sent[tkey])
        else:
            need = {
                "F": [("RECV_F", k > 0)],
                "B": [("F", True), ("RECV_B", k < last)],
                "W": [("B", True)],
            }[a.kind]
            for dep, applies in need:
                if applies and (dep, a.microbatch, a.chunk) not in r.done:
                    fail(r, a, f"runs before its {dep}")
            d = duration["B_input" if a.kind == "B" and (a.microbatch, a.chunk) in split[r.rank] else a.kind]
            start, r.clock = r.clock, r.clock + d
            r.busy += d
            r.timeline.append((start, r.clock, a))
            if a.kind == "F":
                r.inflight += 1
                r.peak = max(r.peak, r.inflight)
            elif a.kind == "B":
                r.inflight -= 1
        r.done.add(key)
        return True

    progressed = True
    while progressed:
        progressed = False
        for r in ranks:
            while r.pc < len(r.actions) and step(r, r.actions[r.pc]):
                r.pc += 1
                progressed = True

    stuck = [r for r in ranks if r.pc < len(r.actions)]
    if stuck:
        detail = "; ".join(f"rank {r.rank} stuck at #{r.pc} {r.actions[r.pc]}" for r in stuck)
        raise DeadlockError(f"deadlock: {detail}")
    unmatched = set(sent) - consumed
    if unmatched:
        raise ScheduleError(f"sends never received (dir, mb, dest stage): {sorted(unmatched)}")
    return SimResult(
        makespan=max((r.clock for r in ranks), default=0),
        busy=[r.busy for r in ranks],
        peak_inflight=[r.peak for r in ranks],
        timelines=[r.timeline for r in ranks],
    )
