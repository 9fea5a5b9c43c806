"""Where a schedule proves a send landed (pipeline/landed.py), checked against a brute-force walk of
the happens-before graph, and what it buys: sent tensors held per rank stop growing with m."""

from collections import deque

import pytest

from lightning_tp.pipeline.schedule.landed import landed_after
from lightning_tp.pipeline.schedule.schedules import build_schedule, message

CASES = [(name, p, m, v) for p in (2, 3, 4) for m in (3, 4, 8, 10, 12)
         for name, v in (("gpipe", 1), ("1f1b", 1), ("zb_h1", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 3))]


def _happens_before(schedule, p):
    """(rank, index) -> set of events it reaches: program order, and each send to its receive."""
    receive = {message(a, r, p): (r, i) for r, ops in enumerate(schedule) for i, a in enumerate(ops)
               if a.kind.startswith("RECV")}
    edges = {}
    for r, ops in enumerate(schedule):
        for i, a in enumerate(ops):
            out = [(r, i + 1)] if i + 1 < len(ops) else []
            if a.kind.startswith("SEND"):
                out.append(receive[message(a, r, p)])
            edges[(r, i)] = out

    def reach(start):
        seen, todo = {start}, deque([start])
        while todo:
            for nxt in edges[todo.popleft()]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen
    return receive, reach


@pytest.mark.parametrize("name, p, m, v", CASES)
def test_each_release_is_the_first_receive_that_proves_the_send_landed(name, p, m, v):
    schedule = build_schedule(name, p, m, v)
    receive, reach = _happens_before(schedule, p)
    points = landed_after(schedule, p)
    for r, ops in enumerate(schedule):
        released = {j: i for i, js in points[r].items() for j in js}
        for j, a in enumerate(ops):
            if not a.kind.startswith("SEND"):
                continue
            after = reach(receive[message(a, r, p)])  # everything that happens after the peer got it
            proofs = [i for i in range(j + 1, len(ops)) if ops[i].kind.startswith("RECV") and (r, i) in after]
            assert released.get(j) == (proofs[0] if proofs else None), (r, j, a)


def _peak_held(schedule, points, r):
    held = peak = 0
    for i, a in enumerate(schedule[r]):
        held += a.kind.startswith("SEND")
        peak = max(peak, held)
        held -= len(points[r].get(i, []))
    return peak


@pytest.mark.parametrize("name, v", [("1f1b", 1), ("zb_h1", 1), ("interleaved_1f1b", 2)])
def test_sent_tensors_held_do_not_grow_with_microbatches(name, v):
    p = 4
    peaks = []
    for m in (8, 16, 32):
        schedule = build_schedule(name, p, m, v)
        points = landed_after(schedule, p)
        peaks.append([_peak_held(schedule, points, r) for r in range(p)])
    assert peaks[0] == peaks[1] == peaks[2], peaks
    if v == 1:  # at most one activation per microbatch in flight, and the gradients coming back
        assert all(peak <= p for peak in peaks[0]), peaks[0]


def test_gpipe_holds_every_activation_until_its_gradient_returns():
    p, m = 4, 8  # all forwards run before any backward: nothing can be proven landed earlier
    schedule = build_schedule("gpipe", p, m)
    points = landed_after(schedule, p)
    assert [_peak_held(schedule, points, r) for r in range(p)] == [m] * p
