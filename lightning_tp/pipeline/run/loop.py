"""The one action loop of a pipeline step, training or forward-only, and the step plan it walks: this rank's
compute actions with the transfers around them. See docs/design/pipeline-run.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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


def walk(plan: StepPlan, step, transport) -> None:
    """The one action loop, of training and forward-only steps alike: each compute action in order, given
    what it receives, then what it sends (``transport``: eager or per slot, see .transfers)."""
    for a in plan.computes:
        step.compute(a, transport.receive(a), transport)
        transport.after(a)
    transport.finish()


