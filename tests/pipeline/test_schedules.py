"""Pure-data checks of pipeline schedules and the replay simulator.

Expected bubbles come from closed forms, never from recorded simulator output:
* GPipe and 1F1B: bubble time (p-1)(T_F+T_B), fraction (p-1)/(m+p-1).
* Interleaved with per-chunk costs F/v, B/v: fraction (p-1)/(v*m+p-1)
  (Narayanan et al. 2021, bubble shrinks by v), for any m >= p, multiple of p or not.
* ZB-H1 with T_F = T_B = T_W: bubble time (p-1)(T_F+T_B-T_W), i.e. one third
  of 1F1B's (p-1)(T_F+T_B+T_W) (Qi et al. 2024, sec. 2.1); as a fraction
  (p-1)/(3m+p-1) when m >= p.
* A split backward with W right after its B (``split_backward``): the gradient
  waits on input halves only, so the bubble time is (p-1)(T_F+T_B) in the
  paper's notation (T_B the input half), per chunk for interleaved.
"""

from collections import Counter
from fractions import Fraction

import pytest

from lightning_tp.pipeline.schedule.schedules import (
    SCHEDULE_NAMES,
    Action,
    build_schedule,
    forward_only,
    gpipe,
    interleaved_1f1b,
    message,
    microbatch_groups,
    one_f_one_b,
    with_split_backward,
    zb_h1,
)
from lightning_tp.pipeline.schedule.simulate import DeadlockError, ScheduleError, simulate

PM = [(1, 1), (1, 3), (2, 1), (2, 2), (2, 5), (3, 7), (4, 3), (4, 4), (4, 8), (4, 16), (8, 8)]
PMV = [(1, 3, 2), (2, 4, 2), (3, 6, 2), (4, 4, 2), (4, 8, 1), (4, 8, 2), (4, 16, 3), (8, 16, 2),
       (2, 3, 2), (4, 6, 2), (4, 9, 2), (4, 10, 3), (3, 5, 4), (8, 12, 2)]  # m % p != 0 too
CASES = [(n, p, m, 1) for n in ("gpipe", "1f1b", "zb_h1") for p, m in PM] + [
    ("interleaved_1f1b", p, m, v) for p, m, v in PMV
]
CASE_IDS = [f"{n}-p{p}-m{m}-v{v}" for n, p, m, v in CASES]


def unit_cost(v=1):
    """F=1, full B=2 per microbatch, spread over v chunks; ZB splits B as 1+1."""
    return {"F": Fraction(1, v), "B": Fraction(2, v), "W": Fraction(1, v)}


def stage(rank, chunk, p):
    return chunk * p + rank


def order_peak_inflight(ops):
    """Peak (F done, B not yet) count from list order alone, independent of the simulator."""
    live = peak = 0
    for a in ops:
        live += {"F": 1, "B": -1}.get(a.kind, 0)
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("name,p,m,v", CASES, ids=CASE_IDS)
def test_schedule_is_deadlock_free_and_keeps_every_rank_equally_busy(name, p, m, v):
    res = simulate(build_schedule(name, p, m, v), p, v, cost=unit_cost(v))
    # same total work everywhere: m microbatches * (F + full B) = 3m
    assert res.busy == [3 * m] * p
    assert res.makespan >= 3 * m


@pytest.mark.parametrize("name,p,m,v", CASES, ids=CASE_IDS)
def test_each_compute_kind_runs_exactly_once_per_microbatch_and_chunk_on_every_rank(name, p, m, v):
    kinds = ("F", "B", "W") if name == "zb_h1" else ("F", "B")
    expected = Counter((k, mb, c) for k in kinds for mb in range(m) for c in range(v))
    for ops in build_schedule(name, p, m, v):
        got = Counter((a.kind, a.microbatch, a.chunk) for a in ops if a.kind in ("F", "B", "W"))
        assert got == expected


@pytest.mark.parametrize("name,p,m,v", CASES, ids=CASE_IDS)
def test_forward_precedes_backward_precedes_weight_per_microbatch_and_chunk(name, p, m, v):
    for ops in build_schedule(name, p, m, v):
        pos = {(a.kind, a.microbatch, a.chunk): i for i, a in enumerate(ops)}
        for mb in range(m):
            for c in range(v):
                assert pos[("F", mb, c)] < pos[("B", mb, c)]
                if name == "zb_h1":
                    assert pos[("B", mb, c)] < pos[("W", mb, c)]


@pytest.mark.parametrize("name,p,m,v", CASES, ids=CASE_IDS)
def test_p2p_wraps_each_pass_and_every_send_has_a_neighbour_recv(name, p, m, v):
    last = p * v - 1
    sched = build_schedule(name, p, m, v)
    sends, recvs = Counter(), Counter()
    for rank, ops in enumerate(sched):
        pos = {(a.kind, a.microbatch, a.chunk): i for i, a in enumerate(ops)}
        assert len(pos) == len(ops), "an action appears twice on one rank"
        for mb in range(m):
            for c in range(v):
                k = stage(rank, c, p)
                f, b = pos[("F", mb, c)], pos[("B", mb, c)]
                assert (("RECV_F", mb, c) in pos) == (k > 0)
                assert (("SEND_F", mb, c) in pos) == (k < last)
                assert (("RECV_B", mb, c) in pos) == (k < last)
                assert (("SEND_B", mb, c) in pos) == (k > 0)
                if k > 0:
                    assert pos[("RECV_F", mb, c)] < f and pos[("SEND_B", mb, c)] > b
                    sends["B", mb, k - 1] += 1
                    recvs["F", mb, k] += 1
                if k < last:
                    assert pos[("SEND_F", mb, c)] > f and pos[("RECV_B", mb, c)] < b
                    sends["F", mb, k + 1] += 1
                    recvs["B", mb, k] += 1
    # a SEND to virtual stage k is matched by exactly one RECV on the rank/chunk owning k
    assert sends == recvs


@pytest.mark.parametrize("p,m", PM)
def test_gpipe_holds_all_m_activations_and_1f1b_at_most_p_minus_s(p, m):
    g, o = gpipe(p, m), one_f_one_b(p, m)
    g_sim, o_sim = simulate(g, p), simulate(o, p)
    assert [order_peak_inflight(ops) for ops in g] == g_sim.peak_inflight == [m] * p
    assert [order_peak_inflight(ops) for ops in o] == o_sim.peak_inflight
    for s, peak in enumerate(o_sim.peak_inflight):
        assert peak <= p - s
        assert peak == min(p - s, m)


@pytest.mark.parametrize("name,p,m,v", CASES, ids=CASE_IDS)
def test_both_ends_of_every_channel_walk_its_microbatches_in_increasing_order(name, p, m, v):
    """The eager Mailbox's contract (pipeline/p2p.py): per channel (direction, receiving virtual
    stage) sender and receiver take the same microbatches in increasing order, so they agree on
    which message carries the header. simulate() matches messages by name and would not notice
    a receiver taking microbatch 1 before 0, which hangs gloo."""
    sends, recvs = {}, {}
    for rank, ops in enumerate(build_schedule(name, p, m, v)):
        for a in ops:
            if a.kind in ("SEND_F", "SEND_B", "RECV_F", "RECV_B"):
                direction, mb, k = message(a, rank, p)
                (sends if a.kind.startswith("SEND") else recvs).setdefault((direction, k), []).append(mb)
    assert set(sends) == set(recvs)
    for channel, order in sends.items():
        assert order == recvs[channel] == sorted(order) == list(range(m)), (channel, order, recvs[channel])


@pytest.mark.parametrize("p", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("v", [1, 2, 3])
def test_forward_only_keeps_the_pipeline_full(p, v):
    """validate/predict: m forwards of a whole microbatch (cost 1, a chunk 1/v) end at m + (p-1)/v
    for m >= p, as a full pipeline of p*v virtual stages does; one microbatch at a time through
    every chunk (the order before) leaves ranks idle while it travels, for any v > 1."""
    for m in range(1, 3 * p + 2):
        sched = forward_only(p, m, v)
        assert all(a.kind in ("F", "SEND_F", "RECV_F") for ops in sched for a in ops)
        res = simulate(sched, p, v, cost=unit_cost(v))
        assert res.busy == [m] * p
        if m >= p:
            assert res.makespan == m + Fraction(p - 1, v)
        one_at_a_time = []
        for s in range(p):
            ops = [op for mb in range(m) for c in range(v)
                   for op in _one_forward(s, p, v, mb, c)]
            one_at_a_time.append(ops)
        before = simulate(one_at_a_time, p, v, cost=unit_cost(v)).makespan
        assert res.makespan <= before and (res.makespan < before or v == 1 or m == 1 or p == 1)
        sends, recvs = {}, {}
        for rank, ops in enumerate(sched):  # the Mailbox's channel order holds here too
            for a in ops:
                if a.kind != "F":
                    direction, mb, k = message(a, rank, p)
                    (sends if a.kind == "SEND_F" else recvs).setdefault(k, []).append(mb)
        assert sends == recvs and all(order == list(range(m)) for order in sends.values())


def _one_forward(s, p, v, mb, c):
    k = c * p + s
    return ([Action("RECV_F", mb, c)] if k > 0 else []) + [Action("F", mb, c)] + \
        ([Action("SEND_F", mb, c)] if k < p * v - 1 else [])


@pytest.mark.parametrize("p,m", PM)
def test_zb_h1_has_the_same_peak_inflight_activations_as_1f1b(p, m):
    assert simulate(zb_h1(p, m), p).peak_inflight == simulate(one_f_one_b(p, m), p).peak_inflight


@pytest.mark.parametrize("p,m,v", [c for c in PMV if c[0] > 1])
def test_interleaved_peak_inflight_is_megatron_warmup_plus_one(p, m, v):
    # Megatron: warmup forwards 2(p-s-1) + (v-1)g with g the microbatch group (p when p | m;
    # here the first, largest group); the first steady-state forward adds one more live activation
    g = -(-m // max(1, m // p))  # ceil(m / number of groups)
    for s, peak in enumerate(simulate(interleaved_1f1b(p, m, v), p, v).peak_inflight):
        assert peak == min(2 * (p - s - 1) + (v - 1) * g + 1, m * v)


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
def test_microbatch_groups_hold_at_least_p_each_and_cover_every_microbatch(p):
    for m in range(1, 5 * p + 2):
        sizes = microbatch_groups(p, m)
        assert sum(sizes) == m and len(sizes) == max(1, m // p)
        assert sizes == sorted(sizes, reverse=True) and sizes[0] - sizes[-1] <= 1
        assert all(g >= p for g in sizes) or sizes == [m]
        if m % p == 0:
            assert sizes == [p] * (m // p)  # Megatron-LM's groups


def test_interleaved_order_walks_each_group_through_every_chunk():
    # p=2, m=5: groups [3, 2]; forwards of rank 0 after its warm-up order: group 0 chunk 0, chunk 1, ...
    ops = [(a.microbatch, a.chunk) for a in interleaved_1f1b(2, 5, 2)[0] if a.kind == "F"]
    assert ops == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1), (3, 0), (4, 0), (3, 1), (4, 1)]
    back = [(a.microbatch, a.chunk) for a in interleaved_1f1b(2, 5, 2)[0] if a.kind == "B"]
    assert back == [(0, 1), (1, 1), (2, 1), (0, 0), (1, 0), (2, 0), (3, 1), (4, 1), (3, 0), (4, 0)]


@pytest.mark.parametrize("p", [2, 3, 4, 6])
@pytest.mark.parametrize("v", [2, 3])
def test_interleaved_with_fewer_microbatches_than_stages_never_loses_to_1f1b(p, v):
    # m < p: rank 0 waits at each chunk change, so the bubble is above (p-1)/(v*m+p-1); still at
    # most 1F1B's on the same m (equal at m = 1, where nothing can interleave)
    for m in range(1, p):
        inter = simulate(interleaved_1f1b(p, m, v), p, v, cost=unit_cost(v))
        base = simulate(one_f_one_b(p, m), p, cost=unit_cost())
        assert inter.bubble_fraction > Fraction(p - 1, v * m + p - 1)
        assert inter.makespan == base.makespan if m == 1 else inter.makespan < base.makespan


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", PM)
def test_gpipe_and_1f1b_bubble_equals_p_minus_1_over_m_plus_p_minus_1(name, p, m):
    res = simulate(build_schedule(name, p, m), p, cost={"F": 1, "B": 2})
    assert res.makespan == 3 * (m + p - 1)
    assert res.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)


@pytest.mark.parametrize("p,m,v", PMV)
def test_interleaved_bubble_equals_p_minus_1_over_vm_plus_p_minus_1(p, m, v):
    res = simulate(interleaved_1f1b(p, m, v), p, v, cost=unit_cost(v))
    assert res.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)
    assert all(i == Fraction(3 * (p - 1), v) for i in res.idle)


@pytest.mark.parametrize("p,m", [(p, m) for p, m in PM if p > 1])
def test_zb_h1_bubble_is_positive_and_at_most_40_percent_of_1f1b(p, m):
    zb = simulate(zb_h1(p, m), p, cost=unit_cost())
    base = simulate(one_f_one_b(p, m), p, cost=unit_cost())
    assert 0 < max(zb.idle) < min(base.idle)
    if m >= p:  # the paper's steady-state analysis assumes at least p microbatches
        # compared as bubble time (the paper's "bubble size"): theory says exactly 1/3
        assert max(zb.idle) <= Fraction(2, 5) * min(base.idle)
        assert zb.idle == [p - 1] * p  # (p-1)(T_F + T_B - T_W) with all three = 1
        assert zb.bubble_fraction == pytest.approx((p - 1) / (3 * m + p - 1), abs=1e-12)
        if m >= 3 * (p - 1):  # only then is the *fraction* ratio (m+p-1)/(3m+p-1) <= 0.4
            assert zb.bubble_fraction <= 0.4 * base.bubble_fraction


@pytest.mark.parametrize("name,p,m,v", [c for c in CASES if c[1] == 1], ids=str)
def test_single_stage_pipeline_has_no_bubble(name, p, m, v):
    assert simulate(build_schedule(name, p, m, v), p, v, cost=unit_cost(v)).bubble_fraction == 0


def test_zb_backward_costs_full_b_minus_w_so_total_work_matches_1f1b():
    cost = {"F": 3, "B": 5, "W": 2}
    zb = simulate(zb_h1(3, 6), 3, cost=cost)
    durations = {a.kind: end - start for tl in zb.timelines for start, end, a in tl}
    assert durations == {"F": 3, "B": 3, "W": 2}
    assert zb.busy == simulate(one_f_one_b(3, 6), 3, cost=cost).busy == [6 * 8] * 3


def test_missing_send_is_reported_as_deadlock_naming_the_stuck_recv():
    sched = one_f_one_b(2, 2)
    sched[0].remove(Action("SEND_F", 1))
    with pytest.raises(DeadlockError, match=r"rank 1 stuck at #\d+ RECV_F\(mb=1, chunk=0\)"):
        simulate(sched, 2)


def test_circular_wait_is_reported_as_deadlock_on_both_ranks():
    # rank 0 waits for a gradient before sending the activation rank 1 needs first
    sched = [
        [Action("F", 0), Action("RECV_B", 0), Action("SEND_F", 0), Action("B", 0)],
        [Action("RECV_F", 0), Action("F", 0), Action("B", 0), Action("SEND_B", 0)],
    ]
    with pytest.raises(DeadlockError) as err:
        simulate(sched, 2)
    assert "rank 0 stuck at #1 RECV_B" in str(err.value)
    assert "rank 1 stuck at #0 RECV_F" in str(err.value)


@pytest.mark.parametrize(
    "sched,msg",
    [
        ([[Action("F", 0), Action("B", 0), Action("B", 0)]], "duplicate"),
        ([[Action("B", 0), Action("F", 0)]], "before its F"),
        ([[Action("F", 0), Action("SEND_F", 0)]], "no next stage"),
        ([[Action("F", 0), Action("W", 0), Action("B", 0)]], "before its B"),
        ([[Action("F", 0, chunk=1), Action("B", 0, chunk=1)]], "chunk out of range"),
    ],
)
def test_malformed_schedule_is_rejected(sched, msg):
    with pytest.raises(ScheduleError, match=msg):
        simulate(sched, 1)


def test_send_that_is_never_received_is_rejected():
    sched = [[Action("F", 0), Action("SEND_F", 0)], []]
    with pytest.raises(ScheduleError, match=r"never received.*\('F', 0, 1\)"):
        simulate(sched, 2)


def test_unknown_schedule_name_lists_the_choices():
    with pytest.raises(ValueError) as err:
        build_schedule("pipedream", 2, 2)
    for name in SCHEDULE_NAMES:
        assert name in str(err.value)


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
@pytest.mark.parametrize("p,m,v", [(0, 4, 1), (2, 0, 1), (-1, 4, 1), (2, 2, 0), (2, 2.0, 1)])
def test_nonpositive_or_non_int_sizes_raise_value_error(name, p, m, v):
    if v == 0 and name != "interleaved_1f1b":
        v = 2  # other schedules reject any v != 1
    with pytest.raises(ValueError):
        build_schedule(name, p, m, v)


def test_build_schedule_dispatches_to_each_builder():
    assert build_schedule("gpipe", 3, 4) == gpipe(3, 4)
    assert build_schedule("1f1b", 3, 4) == one_f_one_b(3, 4)
    assert build_schedule("interleaved_1f1b", 3, 6, 2) == interleaved_1f1b(3, 6, 2)
    assert build_schedule("zb_h1", 3, 4) == zb_h1(3, 4)


def test_action_rejects_unknown_kind_and_negative_indices():
    with pytest.raises(ValueError):
        Action("X", 0)
    with pytest.raises(ValueError):
        Action("F", -1)
    with pytest.raises(ValueError):
        Action("F", 0, chunk=-1)


def test_early_publish_fills_the_last_wait_where_the_last_stage_is_done():
    """A stage publishes the step's logs before its last receive only where the unit replay has the
    last stage finished by then (so the numbers are there) and no forward comes after it."""
    from lightning_tp.pipeline.run.logs import early_publish

    p, m = 4, 8
    sched = build_schedule("1f1b", p, m)
    points = early_publish(sched, p)
    assert points[p - 1] is None  # the last stage has the numbers itself
    assert sched[0][points[0]] == Action("RECV_B", m - 1, 0)  # the first stage: before its last gradient
    res = simulate(sched, p)
    last_end = max(end for _, end, _ in res.timelines[p - 1])
    for r, at in enumerate(points[:-1]):
        last_recv = max(i for i, a in enumerate(sched[r]) if a.kind.startswith("RECV"))
        computed = [a for a in sched[r][:last_recv] if a.kind in ("F", "B", "W")]
        reached = res.timelines[r][len(computed) - 1][1]
        assert at == (last_recv if reached >= last_end else None), r
    assert early_publish(build_schedule("zb_h1", p, m), p) == [None] * p  # W fills the time: do not wait
    inter = build_schedule("interleaved_1f1b", p, m, 2)
    for r, at in enumerate(early_publish(inter, p, 2)[:-1]):
        assert at is not None and not any(a.kind == "F" for a in inter[r][at:])


def _replay_with_publish(sched, p, v, points) -> bool:
    """Every rank walks its actions with the executor's gloo rules: a RECV waits for its SEND; the
    step ends with waiting on the rank's sends, each of which completes only once its receiver has
    posted it (message j of a channel is posted when the receiver takes message j - 2, the Mailbox's
    depth; the first message when it is taken, as on a first step); PUBLISH (at the rank's point, or
    at its end after the sends) is a barrier over all ranks, as a step that sends new log names is.
    True if every rank finishes."""
    lines = []
    for r, ops in enumerate(sched):
        steps = list(ops) + ["WAIT_SENDS"]
        steps.insert(points[r] if points[r] is not None else len(steps), "PUBLISH")
        lines.append(steps)
    pc, sent, reached, published = [0] * p, set(), {}, set()
    index = {}  # (rank, action) -> its message number on its channel
    for r, ops in enumerate(sched):
        count = Counter()
        for a in ops:
            if a.kind.startswith("RECV"):
                index[(r, a)] = count[(a.kind, a.chunk)]
                count[(a.kind, a.chunk)] += 1

    def receiver(r, a):
        k = a.chunk * p + r + (1 if a.kind == "SEND_F" else -1)
        return k % p, Action("RECV_" + a.kind[-1], a.microbatch, k // p)

    def posted(r, a):
        dst, recv = receiver(r, a)
        return reached.get((dst, recv.kind, recv.chunk), -1) >= max(index[(dst, recv)] - 2, 0)
    progressed = True
    while progressed:
        progressed = False
        for r in range(p):
            while pc[r] < len(lines[r]):
                step = lines[r][pc[r]]
                if step == "PUBLISH":
                    published.add(r)
                    if len(published) < p:
                        break
                elif step == "WAIT_SENDS":
                    if not all(posted(r, a) for a in sched[r] if a.kind.startswith("SEND")):
                        break
                elif step.kind.startswith("SEND"):
                    sent.add(receiver(r, step))
                elif step.kind.startswith("RECV"):
                    key = (r, step.kind, step.chunk)
                    reached[key] = max(reached.get(key, -1), index[(r, step)])
                    if (r, step) not in sent:
                        break
                pc[r] += 1
                progressed = True
        if len(published) == p:  # the barrier opens for everyone
            for r in range(p):
                if pc[r] < len(lines[r]) and lines[r][pc[r]] == "PUBLISH":
                    pc[r] += 1
                    progressed = True
            published = {-1}
    return all(pc[r] == len(lines[r]) for r in range(p))


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_early_publish_never_hangs_even_as_a_barrier(name):
    from lightning_tp.pipeline.run.logs import early_publish

    for p in (2, 3, 4, 6):
        for v in ((1, 2, 3) if name == "interleaved_1f1b" else (1,)):
            ms = (1, p - 1, p, p + 1, 2 * p, 2 * p + 1, 4 * p) if name == "interleaved_1f1b" else (1, 2, p, 2 * p + 1)
            for m in ms:
                sched = build_schedule(name, p, m, v)
                points = early_publish(sched, p, v)
                assert _replay_with_publish(sched, p, v, points), (name, p, v, m, points)
                assert _replay_with_publish(sched, p, v, [None] * p)
    # the replay can fail: a point on rank 1 alone leaves rank 0 waiting for rank 1's last gradient
    sched = build_schedule("1f1b", 4, 8)
    assert not _replay_with_publish(sched, 4, 1, [None, early_publish(sched, 4)[1], None, None])
    # and so can a point before a channel's first message, whose receive is posted only when taken
    sched = build_schedule("gpipe", 2, 1)
    assert early_publish(sched, 2) == [None, None]
    assert not _replay_with_publish(sched, 2, 1, [len(sched[0]) - 2, None])


SPLIT = [c for c in CASES if c[0] != "zb_h1"]


@pytest.mark.parametrize("name,p,m,v", SPLIT, ids=[f"{n}-p{p}-m{m}-v{v}" for n, p, m, v in SPLIT])
def test_split_backward_keeps_the_order_and_memory_and_runs_each_w_right_after_its_b(name, p, m, v):
    plain, split = build_schedule(name, p, m, v), build_schedule(name, p, m, v, split_backward=True)
    for ops, new in zip(plain, split):
        assert [a for a in new if a.kind != "W"] == ops  # the schedule's own actions, in its order
        for i, a in enumerate(new):
            if a.kind == "W":  # right after its B, or after the B's send where the B sends
                before = new[i - 1] if new[i - 1].kind == "B" else new[i - 2]
                assert (before.kind, before.microbatch, before.chunk) == ("B", a.microbatch, a.chunk)
                assert new[i - 1].kind in ("B", "SEND_B")
    cost = unit_cost(v)
    res = simulate(split, p, v, cost)  # deadlock-free, every W after its B (checked by the replay)
    assert res.peak_inflight == simulate(plain, p, v, cost).peak_inflight
    assert all(i == (p - 1) * (cost["F"] + cost["B"] - cost["W"]) for i in res.idle)


@pytest.mark.parametrize("p,m", [(2, 5), (4, 8), (8, 8)])
def test_split_backward_shortens_1f1b_by_p_minus_1_weight_halves_and_leaves_zb_h1_alone(p, m):
    cost = {"F": 3, "B": 5, "W": 2}
    plain = simulate(one_f_one_b(p, m), p, cost=cost).makespan
    assert simulate(with_split_backward(one_f_one_b(p, m)), p, cost=cost).makespan == plain - (p - 1) * cost["W"]
    assert build_schedule("zb_h1", p, m, split_backward=True) == zb_h1(p, m)
    with pytest.raises(ValueError, match="split_backward must be True, False or 'drain'"):
        build_schedule("1f1b", p, m, split_backward="yes")


DRAIN = [(n, p, m, v) for n in ("gpipe", "1f1b", "interleaved_1f1b") for p in (1, 2, 3, 4, 6)
         for v in ((1, 2, 3) if n == "interleaved_1f1b" else (1,)) for m in range(1, 3 * p + 2)]


def test_drain_split_keeps_the_whole_gain_at_a_bounded_count_of_splits():
    """split_backward="drain" splits only the backwards after each rank's last forward: every replay
    where W is at most the input half takes exactly as long as splitting every backward, with the
    plain schedule's actions, order and peak memory, at most p splits per rank and step under 1F1B
    and (2p - 1)·v under interleaved, whatever m (GPipe: its whole backward phase is a drain)."""
    for name, p, m, v in DRAIN:
        plain, full = build_schedule(name, p, m, v), build_schedule(name, p, m, v, split_backward=True)
        drain = build_schedule(name, p, m, v, split_backward="drain")
        for ops, new, every in zip(plain, drain, full):
            assert [a for a in new if a.kind != "W"] == ops
            last_f = max(i for i, a in enumerate(ops) if a.kind == "F")
            after = [(a.microbatch, a.chunk) for a in ops[last_f:] if a.kind == "B"]
            assert [(a.microbatch, a.chunk) for a in new if a.kind == "W"] == after
            pairs = [a for a in new if a.kind in ("B", "W") and (a.microbatch, a.chunk) in after]
            assert pairs == [a for a in every if a.kind in ("B", "W") and (a.microbatch, a.chunk) in after]
            bound = {"gpipe": m, "1f1b": p, "interleaved_1f1b": (2 * p - 1) * v}[name]
            assert len(after) <= bound, (name, p, m, v)
        for cost in (unit_cost(v), {"F": 3, "B": 5, "W": 2}, {"F": 3, "B": 6, "W": 3}):
            res = simulate(drain, p, v, cost)
            assert res.makespan == simulate(full, p, v, cost).makespan, (name, p, m, v, cost)
            assert res.peak_inflight == simulate(plain, p, v, cost).peak_inflight
    # a W longer than the input half: splitting every backward also shortens the steady state
    cost = {"F": 10, "B": 20, "W": 14}
    plain, full = build_schedule("1f1b", 4, 8), build_schedule("1f1b", 4, 8, split_backward=True)
    drain = build_schedule("1f1b", 4, 8, split_backward="drain")
    times = [simulate(s, 4, 1, cost).makespan for s in (plain, drain, full)]
    assert times[0] > times[1] > times[2], times


def test_simulate_costs_a_b_without_its_w_as_a_whole_backward():
    sched = build_schedule("1f1b", 2, 2, split_backward="drain")  # rank 1: F0 B0 F1 B1 W1
    cost = {"F": 3, "B": 5, "W": 2}
    ends = [(a.kind, a.microbatch, end - start) for start, end, a in simulate(sched, 2, 1, cost).timelines[1]]
    assert ends == [("F", 0, 3), ("B", 0, 5), ("F", 1, 3), ("B", 1, 3), ("W", 1, 2)]


def test_auto_split_backward_is_the_drain_split_where_it_pays():
    from lightning_tp.pipeline.schedule.schedules import resolve_split_backward as resolve

    for schedule in ("gpipe", "1f1b", "interleaved_1f1b"):
        assert resolve("auto", schedule, 2) == "drain"
        assert resolve("auto", schedule, 1) is False  # no pipeline: no gradient goes anywhere
        assert resolve("auto", schedule, 4, activation_checkpointing=2) is False  # W would recompute again
        assert resolve("auto", schedule, 4, encoder_decoder=True) is False
    assert resolve("auto", "zb_h1", 4) is False  # splits on its own
    for value in (True, False, "drain"):
        assert resolve(value, "1f1b", 4, activation_checkpointing=True, encoder_decoder=True) is value
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="use 'auto', 'drain', True or False"):
            resolve(bad, "1f1b", 4)
