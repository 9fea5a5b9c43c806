"""The step plan a pipeline step's action loop walks, as pure data: each compute action with the RECV right before
it and the SEND right after it, and the sends an eager step makes inside their compute action (marked early)."""

import pytest

from lightning_tp.pipeline.run.loop import step_plan
from lightning_tp.pipeline.run.transfers import Routes
from lightning_tp.pipeline.schedule.schedules import Action, build_schedule, forward_only, sent_early, turns
from lightning_tp.pipeline.schedule.slots import slot_plan

CASES = [("gpipe", 4, 8, 1, False), ("1f1b", 4, 8, 1, False), ("1f1b", 4, 8, 1, "drain"), ("1f1b", 3, 2, 1, True),
         ("interleaved_1f1b", 4, 8, 2, False), ("interleaved_1f1b", 4, 6, 2, "drain"), ("zb_h1", 4, 8, 1, False),
         ("1f1b", 1, 3, 1, False)]


def _ranks(name, p, m, v, split):
    return build_schedule(name, p, m, v, split) + forward_only(p, m, v)


@pytest.mark.parametrize("name, p, m, v, split", CASES)
def test_turns_pair_each_compute_action_with_its_receive_and_send(name, p, m, v, split):
    for actions in _ranks(name, p, m, v, split):
        order = turns(actions)
        assert [x for turn in order for x in turn if x is not None] == actions  # nothing lost or moved
        for recv, compute, send in order:
            assert compute.kind in ("F", "B", "W")
            assert recv is None or (recv.kind, recv.microbatch, recv.chunk) == ("RECV_" + compute.kind,
                                                                                 compute.microbatch, compute.chunk)
            assert send is None or (send.kind, send.microbatch, send.chunk) == ("SEND_" + compute.kind,
                                                                                 compute.microbatch, compute.chunk)


@pytest.mark.parametrize("actions", [[Action("RECV_F", 0)], [Action("SEND_F", 0)],
                                     [Action("F", 0), Action("SEND_F", 1)], [Action("RECV_F", 0), Action("B", 0)],
                                     [Action("RECV_F", 0), Action("RECV_F", 1), Action("F", 0)]])
def test_turns_refuse_a_transfer_away_from_its_compute_action(actions):
    with pytest.raises(ValueError, match="must come right"):
        turns(actions)


@pytest.mark.parametrize("name, p, m, v, split", CASES)
def test_sent_early_marks_every_send_and_keeps_every_transfer_in_place(name, p, m, v, split):
    for actions in _ranks(name, p, m, v, split):
        marked = sent_early(actions)
        assert marked == actions  # the same transfers, in the same order: early is not compared
        assert [a.early for a in marked] == [a.kind in ("SEND_F", "SEND_B") for a in actions]
        assert not any(a.early for a in actions)  # a pure transform
        for recv, compute, send in turns(marked):  # each made inside the compute action right before it
            assert send is None or send.early


def test_an_early_send_says_so_and_only_a_send_is_early():
    assert str(Action("SEND_B", 2, 1, early=True)) == "SEND_B(mb=2, chunk=1, early)"
    assert Action("SEND_F", 0, early=True) == Action("SEND_F", 0)
    assert hash(Action("SEND_F", 0, early=True)) == hash(Action("SEND_F", 0))
    for kind in ("F", "B", "W", "RECV_F", "RECV_B"):
        with pytest.raises(ValueError, match="only a SEND"):
            Action(kind, 0, early=True)


def test_an_eager_plan_sends_early_and_a_batched_one_in_its_slots():
    p, m = 4, 8
    full = build_schedule("1f1b", p, m)
    routes = Routes(lambda k: k % p, lambda chunk: chunk * p + 1, p)  # rank 1's view
    eager, batched = step_plan(full[1], None, routes), step_plan(full[1], slot_plan(full, p)[1], routes)
    for plan in (eager, batched):
        assert plan.actions == full[1] and plan.computes == [a for a in full[1] if a.kind in ("F", "B")]
        assert plan.receives[Action("F", 3)] == Action("RECV_F", 3)
        assert plan.sends[Action("B", 3)] == Action("SEND_B", 3)
    assert all(a.early for a in eager.sends.values()) and not any(a.early for a in batched.sends.values())
    assert eager.expected == routes.expected(full[1]) and batched.expected == {}
