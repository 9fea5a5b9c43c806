"""The step plan a pipeline step's action loop walks, as pure data: each compute action with the RECV right before
it and the SEND right after it."""

import pytest

from lightning_tp.pipeline.schedule.schedules import Action, build_schedule, forward_only, turns

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
