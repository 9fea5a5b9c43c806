"""Pipeline-parallel schedules as pure data: one ordered :class:`Action` list per pipeline rank.

Conventions (virtual stages, chunks, where SEND/RECV sit, B and W): docs/design/pipeline-schedules.md.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace

COMPUTE_KINDS = ("F", "B", "W")
P2P_KINDS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
KINDS = COMPUTE_KINDS + P2P_KINDS
SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1")


@dataclass(frozen=True)
class Action:
    """One step of one rank: a compute pass or one half of a P2P transfer."""

    kind: str
    microbatch: int
    chunk: int = 0
    # a SEND made inside the compute action before it (see sent_early); the same transfer, so not compared
    early: bool = field(default=False, compare=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown action kind {self.kind!r}; expected one of {KINDS}")
        if self.microbatch < 0 or self.chunk < 0:
            raise ValueError(f"microbatch and chunk must be >= 0, got {self}")
        if self.early and self.kind not in ("SEND_F", "SEND_B"):
            raise ValueError(f"only a SEND leaves early, got {self.kind}")

    def __str__(self) -> str:
        return f"{self.kind}(mb={self.microbatch}, chunk={self.chunk}{', early' if self.early else ''})"


Schedule = list[list[Action]]


def message(a: Action, rank: int, p: int) -> tuple:
    """The transfer a SEND or RECV action on ``rank`` takes part in: (direction "F" or "B",
    microbatch, receiving virtual stage), the same for both of its ends."""
    k = a.chunk * p + rank
    if a.kind == "SEND_F":
        return "F", a.microbatch, k + 1
    if a.kind == "SEND_B":
        return "B", a.microbatch, k - 1
    return a.kind[-1], a.microbatch, k


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


class _RankOps:
    """Appends compute actions for one rank with their P2P neighbours attached."""

    def __init__(self, rank: int, p: int, v: int) -> None:
        self.rank, self.p, self.last = rank, p, p * v - 1
        self.ops: list[Action] = []

    def _stage(self, chunk: int) -> int:
        return chunk * self.p + self.rank

    def forward(self, mb: int, chunk: int = 0) -> None:
        k = self._stage(chunk)
        if k > 0:
            self.ops.append(Action("RECV_F", mb, chunk))
        self.ops.append(Action("F", mb, chunk))
        if k < self.last:
            self.ops.append(Action("SEND_F", mb, chunk))

    def backward(self, mb: int, chunk: int = 0) -> None:
        k = self._stage(chunk)
        if k < self.last:
            self.ops.append(Action("RECV_B", mb, chunk))
        self.ops.append(Action("B", mb, chunk))
        if k > 0:
            self.ops.append(Action("SEND_B", mb, chunk))

    def weight(self, mb: int, chunk: int = 0) -> None:
        self.ops.append(Action("W", mb, chunk))


def gpipe(p: int, m: int) -> Schedule:
    """All forwards, then all backwards: simplest, but holds m activations."""
    _check_positive(p=p, m=m)
    schedule = []
    for s in range(p):
        r = _RankOps(s, p, 1)
        for mb in range(m):
            r.forward(mb)
        for mb in range(m):
            r.backward(mb)
        schedule.append(r.ops)
    return schedule


def one_f_one_b(p: int, m: int) -> Schedule:
    """PipeDream-flush 1F1B: same bubble as GPipe, at most p - s activations held on rank s.
    Rank s runs min(p - s - 1, m) warmup forwards, then pairs each forward with the oldest backward."""
    _check_positive(p=p, m=m)
    schedule = []
    for s in range(p):
        r = _RankOps(s, p, 1)
        warmup = min(p - s - 1, m)
        for mb in range(warmup):
            r.forward(mb)
        for i in range(m - warmup):
            r.forward(warmup + i)
            r.backward(i)
        for mb in range(m - warmup, m):
            r.backward(mb)
        schedule.append(r.ops)
    return schedule


def microbatch_groups(p: int, m: int) -> list[int]:
    """Sizes of the groups interleaved 1F1B walks through all chunks before the next: as many as
    fit with at least ``p`` each (one if ``m < p``), sizes as equal as possible, larger first.
    See docs/design/pipeline-schedules.md."""
    n = max(1, m // p)
    return [m // n + (i < m % n) for i in range(n)]


def _group_order(p: int, m: int, v: int, reverse: bool = False) -> list[tuple[int, int]]:
    """(microbatch, chunk) pairs: group by group, each through every chunk (last first if
    ``reverse``: the backward), microbatches in order within a chunk."""
    order, first = [], 0
    for g in microbatch_groups(p, m):
        for c in range(v):
            order += [(first + j, v - 1 - c if reverse else c) for j in range(g)]
        first += g
    return order


def interleaved_1f1b(p: int, m: int, v: int) -> Schedule:
    """Megatron's interleaved 1F1B with v model chunks per rank, for any m: each group of
    :func:`microbatch_groups` runs through every chunk before the next; rank s warms up with
    ``2 * (p - s - 1) + (v - 1) * g`` forwards (g: the first group). See docs/design/pipeline-schedules.md."""
    _check_positive(p=p, m=m, v=v)
    forward, backward = _group_order(p, m, v), _group_order(p, m, v, reverse=True)
    total, group = m * v, microbatch_groups(p, m)[0]

    schedule = []
    for s in range(p):
        r = _RankOps(s, p, v)
        warmup = min(2 * (p - s - 1) + (v - 1) * group, total)
        for k in range(warmup):
            r.forward(*forward[k])
        for i in range(total - warmup):
            r.forward(*forward[warmup + i])
            r.backward(*backward[i])
        for k in range(total - warmup, total):
            r.backward(*backward[k])
        schedule.append(r.ops)
    return schedule


def zb_h1(p: int, m: int) -> Schedule:
    """ZB-H1 (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", section 2.1): 1F1B's F/B order
    and warmup with each backward split into B (input half) and W (weight half), rank s deferring its
    first s W. See docs/design/pipeline-schedules.md."""
    _check_positive(p=p, m=m)
    schedule = []
    for s in range(p):
        r = _RankOps(s, p, 1)
        warmup = min(p - s - 1, m)
        pending_w: deque[int] = deque()

        def backward_then_maybe_w(mb: int, index: int) -> None:
            r.backward(mb)
            pending_w.append(mb)
            if index >= s:  # the (index)th backward on rank s; delay the first s W
                r.weight(pending_w.popleft())

        for mb in range(warmup):
            r.forward(mb)
        for i in range(m - warmup):
            r.forward(warmup + i)
            backward_then_maybe_w(i, i)
        for mb in range(m - warmup, m):
            backward_then_maybe_w(mb, mb)
        while pending_w:
            r.weight(pending_w.popleft())
        schedule.append(r.ops)
    return schedule


def forward_only(p: int, m: int, v: int = 1) -> Schedule:
    """validate/test/predict: the forwards alone, in interleaved 1F1B's order (GPipe's for v = 1),
    in groups of :func:`microbatch_groups`. See docs/design/pipeline-schedules.md."""
    _check_positive(p=p, m=m, v=v)
    schedule = []
    for s in range(p):
        r = _RankOps(s, p, v)
        for mb, c in _group_order(p, m, v):
            r.forward(mb, c)
        schedule.append(r.ops)
    return schedule


def with_split_backward(schedule: Schedule, drain_only: bool = False) -> Schedule:
    """The same schedule with each backward split as ZB-H1 splits it, its W right after its B
    (``drain_only``: only the backwards after a rank's last forward). A schedule that already splits is
    returned as is. See docs/design/pipeline-schedules.md."""
    if any(a.kind == "W" for ops in schedule for a in ops):
        return schedule
    out = []
    for ops in schedule:  # a stage's SEND_B comes right after its B (docs/design/pipeline-schedules.md, conventions)
        last_f = max((i for i, a in enumerate(ops) if a.kind == "F"), default=-1) if drain_only else -1
        new = []
        for i, a in enumerate(ops):
            if new and new[-1].kind == "B" and a.kind != "SEND_B" and i - 1 > last_f:  # a B that sends nothing
                new.append(Action("W", new[-1].microbatch, new[-1].chunk))
            new.append(a)
            if a.kind == "SEND_B" and i - 1 > last_f:
                new.append(Action("W", a.microbatch, a.chunk))
        if new and new[-1].kind == "B" and len(ops) - 1 > last_f:
            new.append(Action("W", new[-1].microbatch, new[-1].chunk))
        out.append(new)
    return out


def sent_early(actions: list[Action]) -> list[Action]:
    """One rank's actions with each SEND marked ``early``: made inside the compute action before it, a SEND_F
    where its F's run stops (at the next stage's first block), a SEND_B as its B returns."""
    return [replace(a, early=True) if a.kind in ("SEND_F", "SEND_B") else a for a in actions]


def turns(actions: list[Action]) -> list[tuple]:
    """One rank's actions as ``(RECV before it or None, compute action, SEND after it or None)`` per compute
    action, in order; an action list of another shape (see the conventions) is refused."""
    out, i = [], 0
    while i < len(actions):
        recv = actions[i] if actions[i].kind in ("RECV_F", "RECV_B") else None
        compute = actions[i + (recv is not None)] if i + (recv is not None) < len(actions) else None
        if compute is None or compute.kind not in COMPUTE_KINDS or \
                (recv is not None and (recv.kind[-1], recv.microbatch, recv.chunk) != _key(compute)):
            raise ValueError(f"action {i} ({actions[i]}): a RECV must come right before its F or B, a SEND "
                             f"right after it")
        i += 1 + (recv is not None)
        send = actions[i] if i < len(actions) and actions[i].kind in ("SEND_F", "SEND_B") else None
        if send is not None:
            if (send.kind[-1], send.microbatch, send.chunk) != _key(compute):
                raise ValueError(f"action {i} ({send}): a SEND must come right after its F or B")
            i += 1
        out.append((recv, compute, send))
    return out


def _key(a: Action) -> tuple:
    return a.kind, a.microbatch, a.chunk


def split_keys(actions: list[Action]) -> set:
    """(microbatch, chunk) of each split backward in a rank's action list: its B is the input half
    and a W follows; any other B is a full backward."""
    return {(a.microbatch, a.chunk) for a in actions if a.kind == "W"}


def resolve_split_backward(value, schedule: str, pp: int, activation_checkpointing=False,
                           encoder_decoder: bool = False) -> bool | str:
    """MegaStrategy's ``split_backward`` with ``"auto"`` made concrete: ``"drain"`` under pp > 1 with
    GPipe, 1F1B or interleaved, unless blocks are recomputed or it is an encoder-decoder pipeline; else
    False. Anything but True, False, "drain" or "auto" is refused. See docs/design/pipeline-schedules.md."""
    if value is True or value is False or value == "drain":
        return value
    if value != "auto":
        raise ValueError(f"MegaStrategy(split_backward={value!r}): use 'auto', 'drain', True or False.")
    plain = pp == 1 or schedule == "zb_h1" or bool(activation_checkpointing) or encoder_decoder
    return False if plain else "drain"


def build_schedule(name: str, p: int, m: int, v: int = 1, split_backward: bool | str = False) -> Schedule:
    """Dispatch by name; v (chunks per rank) only applies to interleaved_1f1b; ``split_backward``
    (True, or ``"drain"`` for the backwards after each rank's last forward only): see
    :func:`with_split_backward` (ZB-H1 always splits)."""
    if name in SCHEDULE_NAMES and name != "interleaved_1f1b" and v != 1:
        raise ValueError(f"schedule {name!r} has one chunk per rank; got v={v}")
    if split_backward is not True and split_backward is not False and split_backward != "drain":
        raise ValueError(f"split_backward must be True, False or 'drain', got {split_backward!r}")
    if name == "gpipe":
        schedule = gpipe(p, m)
    elif name == "1f1b":
        schedule = one_f_one_b(p, m)
    elif name == "interleaved_1f1b":
        schedule = interleaved_1f1b(p, m, v)
    elif name == "zb_h1":
        return zb_h1(p, m)
    else:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULE_NAMES)}")
    return with_split_backward(schedule, split_backward == "drain") if split_backward else schedule
