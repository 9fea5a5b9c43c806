"""Slot grouping of pipeline transfers (what NCCL needs), checked without processes: every transfer
sits in the same slot on both sides, a tensor is used after the slot it arrives in, and a replay
with NCCL's rule (a send completes only while the matching receive is in its peer's running group;
a rank runs its groups one after another) finishes for every schedule. The same replay deadlocks on
transfers issued one by one in action-list order, so it can fail."""

import pytest

from lightning_tp.pipeline.schedule.schedules import Action, build_schedule, forward_only
from lightning_tp.pipeline.schedule.slots import producer, slot_plan

CASES = [(name, p, m, 2 if name == "interleaved_1f1b" else 1)
         for name in ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1") for p in (2, 3, 4) for m in (3, 4, 8, 10, 12)]
CASES += [("forward_only", p, m, v) for p in (2, 3, 4) for m in (1, 3, 4, 10) for v in (1, 2, 3)]  # validate/predict


def _schedule(name, p, m, v):
    return forward_only(p, m, v) if name == "forward_only" else build_schedule(name, p, m, v)


def _message(a, rank, p):
    """A transfer's identity, the same on both sides: (direction, microbatch, producing rank, chunk)."""
    src, made = producer(a, rank, p)
    return a.kind[-1], made.microbatch, src, made.chunk


def _op(a, rank, p):
    k = a.chunk * p + rank
    send = a.kind.startswith("SEND")
    other = k + 1 if (a.kind[-1] == "F") == send else k - 1
    return ("send" if send else "recv", other % p, _message(a, rank, p))


def rendezvous(groups: list) -> bool:
    """True when every rank gets through its groups under NCCL's rule (see the module docstring)."""
    at, done = [0] * len(groups), set()
    progressed = True
    while progressed:
        progressed = False
        for r, line in enumerate(groups):
            while at[r] < len(line):
                for kind, peer, msg in line[at[r]]:
                    if (r, kind, msg) in done or at[peer] >= len(groups[peer]):
                        continue
                    twin = ("recv" if kind == "send" else "send", r, msg)
                    if twin in groups[peer][at[peer]]:
                        done |= {(r, kind, msg), (peer, twin[0], msg)}
                if not all((r, kind, msg) in done for kind, _, msg in line[at[r]]):
                    break
                at[r] += 1
                progressed = True
    return all(at[r] == len(line) for r, line in enumerate(groups))


@pytest.mark.parametrize("name, p, m, v", CASES)
def test_each_transfer_shares_a_slot_and_nccl_cannot_deadlock(name, p, m, v):
    plan = slot_plan(_schedule(name, p, m, v), p, v)
    slot_of = {}
    for r, line in enumerate(plan):
        seen = set()
        for slot in line:
            for a in slot.sends + slot.recvs:
                slot_of[(r, a.kind[:4], _message(a, r, p))] = slot.index
            if slot.compute is not None:
                seen.add(slot.compute)
            for a in slot.recvs:  # arrives in this slot: its user runs in a later one
                assert Action(a.kind[-1], a.microbatch, a.chunk) not in seen
    for (r, kind, msg), t in slot_of.items():
        if kind == "SEND":
            receiver = [(q, k, mm) for (q, k, mm) in slot_of if k == "RECV" and mm == msg]
            assert len(receiver) == 1 and slot_of[receiver[0]] == t, (name, msg)
    groups = [[[_op(a, r, p) for a in slot.sends + slot.recvs] for slot in line] for r, line in enumerate(plan)]
    for line in groups:  # NCCL matches by order per peer: at most one message per direction and peer a slot
        for g in line:
            assert len({(kind, peer) for kind, peer, _ in g}) == len(g), g
    assert rendezvous([[g for g in line if g] for line in groups])


@pytest.mark.parametrize("name", ["1f1b", "interleaved_1f1b"])
def test_transfers_one_by_one_in_list_order_deadlock_under_nccl_rules(name):
    p, m, v = 4, 8, 2 if name == "interleaved_1f1b" else 1
    schedule = build_schedule(name, p, m, v)
    groups = [[[_op(a, r, p)] for a in ops if a.kind in ("SEND_F", "SEND_B", "RECV_F", "RECV_B")]
              for r, ops in enumerate(schedule)]
    assert not rendezvous(groups)
