"""The one action loop of a pipeline step, training or forward-only, and the step plan it walks: this rank's
compute actions with the transfers around them. See docs/design/pipeline-run.md.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..schedule.schedules import Action, sent_early, turns


@dataclass(frozen=True)
class StepPlan:
    """One step's schedule on this rank as :func:`walk` and its transport read it (built once per microbatch
    count; the training fields are empty for a forward-only step's)."""

    actions: list  # this rank's action list (eager: its sends marked early, see ..schedule.schedules)
    computes: list  # its F, B and W in order
    receives: dict  # compute action -> the RECV right before it
    sends: dict  # compute action -> the SEND right after it
    slots: list | None = None  # batched (NCCL): this rank's time slots (see ..schedule.slots)
    expected: dict = field(default_factory=dict)  # eager: channel -> [(tag, src)] of its receives, posted ahead
    landed: dict = field(default_factory=dict)  # eager training: RECV -> tags of the sends its arrival proves landed
    publish_before: Action | None = None  # eager training: the RECV before which the logs are published
    split: set = field(default_factory=set)  # (microbatch, chunk) of the backwards split into B and W
    final: set = field(default_factory=set)  # each chunk's final weight-gradient pass (see BackwardStep._syncing)
    final_b: set = field(default_factory=set)  # split: each chunk's last B


def step_plan(actions, slots, routes, **training) -> StepPlan:
    """The :class:`StepPlan` of this rank's ``actions``; ``slots``: batched, else eager (its sends made inside
    their compute actions)."""
    actions = sent_early(actions) if slots is None else actions
    order = turns(actions)
    return StepPlan(actions, [c for _, c, _ in order], {c: r for r, c, _ in order if r is not None},
                    {c: s for _, c, s in order if s is not None}, slots,
                    routes.expected(actions) if slots is None else {}, **training)


def walk(plan: StepPlan, step, transport, trace=None) -> None:
    """The one action loop, of training and forward-only steps alike: each compute action in order, given
    what it receives, then what it sends (``transport``: eager or per slot, see .transfers); ``trace``: an
    :class:`ActionTrace` noting when each wait and action ran."""
    clock = trace.clock if trace is not None and trace.on else None
    for a in plan.computes:
        start = clock() if clock else None
        received = transport.receive(a)
        computed = clock() if clock else None
        step.compute(a, received, transport)
        transport.after(a)
        if clock:
            trace.note(a, start, computed, clock())
    transport.finish()


class ActionTrace:
    """Chrome/Perfetto trace events of the actions walked while ``on``: process ``pid`` (the global rank), its
    compute actions on one row and the waits for their inputs on another; ``rank``: its pp rank. On a CUDA
    ``device`` the times are CUDA events (when the GPU ran the work), not the host's launch times."""

    def __init__(self, rank: int, stages: int, pid: int, device=None):
        self.rank, self.stages, self.pid, self.on, self._events = rank, stages, pid, False, []
        self.cuda = device is not None and torch.device(device).type == "cuda"
        self._pending, self._base = [], None  # CUDA: (action, events) not yet read; (event, host ns) of time 0

    def clock(self):
        """Now: host nanoseconds, or on CUDA an event recorded on the current stream."""
        if not self.cuda:
            return time.time_ns()
        if self._base is None:  # once: the GPU idle, so this event's time is the host's
            torch.cuda.synchronize()
            self._base = (torch.cuda.Event(enable_timing=True), time.time_ns())
            self._base[0].record()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def note(self, a: Action, start, computed, end) -> None:
        if not self.on:
            return
        if self.cuda:
            self._pending.append((a, start, computed, end))
        else:
            self._add(a, start, computed, end)

    @property
    def events(self) -> list:
        """The trace events noted so far (on CUDA: waits for the GPU to reach the last one)."""
        if self._pending:
            self._pending[-1][3].synchronize()
            base, host = self._base
            ns = lambda e: host + base.elapsed_time(e) * 1e6  # noqa: E731 - elapsed_time is in ms
            for a, *marks in self._pending:
                self._add(a, *map(ns, marks))
            self._pending = []
        return self._events

    def _add(self, a: Action, start: float, computed: float, end: float) -> None:
        k = a.chunk * self.stages + self.rank
        if computed - start > 1000:  # over a microsecond waiting for the input
            self._events.append(dict(name="wait", ph="X", pid=self.pid, tid=1, ts=start / 1e3,
                                     dur=(computed - start) / 1e3, args=dict(microbatch=a.microbatch, stage=k)))
        self._events.append(dict(name=a.kind, ph="X", pid=self.pid, tid=0, ts=computed / 1e3,
                                 dur=(end - computed) / 1e3, args=dict(microbatch=a.microbatch, chunk=a.chunk, stage=k)))
