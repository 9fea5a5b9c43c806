"""When a sent tensor has certainly arrived, read off the schedule (vector clocks over a replay), so a
gloo sender can wait on it there and drop it. See docs/design/pipeline-schedules.md.
"""

from __future__ import annotations

from .schedules import Schedule, message


def landed_after(schedule: Schedule, p: int) -> list[dict[int, list[int]]]:
    """Per rank: {index of a RECV: [indices of this rank's SENDs known to have arrived once it
    returned]}, each send at its earliest such receive; a send with none stays to step end.
    Assumes a deadlock-free schedule (``simulate`` checks that)."""
    n = len(schedule)
    clocks = [[0] * n for _ in range(n)]  # clocks[r][q]: actions of rank q that happen before r's next
    stamp = [[None] * len(ops) for ops in schedule]  # vector clock after each action
    sent, received_at = {}, {}  # message -> sender's clock at the send; -> (rank, index) of its receive
    pc = [0] * n
    progressed = True
    while progressed:
        progressed = False
        for r, ops in enumerate(schedule):
            while pc[r] < len(ops):
                a = ops[pc[r]]
                if a.kind in ("RECV_F", "RECV_B"):
                    key = message(a, r, p)
                    if key not in sent:
                        break
                    clocks[r] = [max(x, y) for x, y in zip(clocks[r], sent[key])]
                    received_at[key] = (r, pc[r])
                clocks[r][r] = pc[r] + 1
                if a.kind in ("SEND_F", "SEND_B"):
                    sent[message(a, r, p)] = list(clocks[r])
                stamp[r][pc[r]] = list(clocks[r])
                pc[r] += 1
                progressed = True
    out = []
    for r, ops in enumerate(schedule):
        points: dict[int, list[int]] = {}
        recvs = [i for i, a in enumerate(ops) if a.kind in ("RECV_F", "RECV_B")]
        for j, a in enumerate(ops):
            if a.kind not in ("SEND_F", "SEND_B"):
                continue
            q, at = received_at[message(a, r, p)]
            proof = next((i for i in recvs if i > j and stamp[r][i][q] > at), None)
            if proof is not None:
                points.setdefault(proof, []).append(j)
        out.append(points)
    return out
