"""An error one rank meets alone is named on the others: a bug in the loss, which under a pipeline
runs on the last stage only, stops the first stage with gloo's "Connection closed by peer", which
then carries the last stage's error (lightning_tp/faults/notes.py)."""

from __future__ import annotations

import time
from datetime import timedelta

import lightning as L
import pytest
import torch
import torch.nn.functional as F

import dist
from helpers import Net, net_loader
from lightning_tp import MegaStrategy
from lightning_tp.faults.notes import FailureNotes, lost_peer

CLOSED = "[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:5534"


def _notes(store):
    first, other = FailureNotes(store, "global rank 1 (pipeline rank 1 of 2)"), FailureNotes(store, "global rank 0")
    other.prefix = first.prefix  # one Trainer entry on two ranks (here: one process)
    return first, other


def test_the_first_error_noted_is_added_to_a_lost_peer():
    failing, waiting = _notes(torch.distributed.HashStore())
    assert lost_peer(RuntimeError(CLOSED)) and lost_peer(RuntimeError("Timed out waiting 60000ms for recv operation"))
    assert not lost_peer(ValueError("connection closed by peer")) and not lost_peer(RuntimeError("shape mismatch"))
    waiting.record(RuntimeError(CLOSED))  # a consequence, never the cause
    failing.record(ValueError("a bug in the loss"))
    waiting.record(ValueError("a later error elsewhere"))  # the first noted stays
    err = RuntimeError(CLOSED)
    waiting.explain(err)
    assert err.__notes__ == ["lightning_tp: global rank 1 (pipeline rank 1 of 2) raised ValueError: a bug in the "
                             "loss\n(this rank, global rank 0, stopped waiting for it)"]
    own = ValueError("its own error")
    waiting.explain(own)  # not a lost peer: left alone
    assert not hasattr(own, "__notes__")


NCCL_LOST = (  # what a survivor's collective raises under NCCL when a peer died (ProcessGroupNCCL's texts)
    "[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE, NumelIn=1, "
    "NumelOut=1, Timeout(ms)=120000) ran for 120014 milliseconds before timing out.",
    "NCCL communicator was aborted on rank 0.",
    "NCCL error in: ProcessGroupNCCL.cpp:3356, remote process exited or there was a network error, NCCL version "
    "2.28.9\nncclRemoteError: A call failed possibly due to a network error or a remote process exiting prematurely.",
)


@pytest.mark.parametrize("text", NCCL_LOST)
def test_a_lost_peer_under_nccl_carries_the_noted_error(text):
    failing, waiting = _notes(torch.distributed.HashStore())
    failing.record(ValueError("a bug in the loss"))
    err = torch.distributed.DistBackendError(text)
    assert lost_peer(err)
    waiting.explain(err)
    assert "raised ValueError: a bug in the loss" in err.__notes__[0]


def test_nothing_is_added_where_nothing_was_noted():
    _, waiting = _notes(torch.distributed.HashStore())
    waiting.wait = timedelta(seconds=0.1)
    err = RuntimeError(CLOSED)
    waiting.explain(err)
    assert not hasattr(err, "__notes__")


class LossBug(Net):
    error = ValueError

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)  # under pp=2 the first stage stops in here; the last one goes on
        if batch_idx == 1:
            raise self.error("a bug in the user's loss code")
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _fit_failing(rank, world, error=ValueError):
    t0 = time.monotonic()
    LossBug.error = error
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=MegaStrategy(pp=2, microbatches=2, timeout=60),
                        max_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, use_distributed_sampler=False)
    try:
        trainer.fit(LossBug(), net_loader())
    except Exception as err:  # returned, and this process exits: as a launcher's would, with its error
        return type(err).__name__, str(err), getattr(err, "__notes__", []), time.monotonic() - t0
    return None


@pytest.mark.parametrize("error", [ValueError, StopIteration])
def test_a_loss_bug_on_the_last_stage_is_named_on_the_first(error):
    """A StopIteration would reach Lightning's loop as this rank's end of epoch (the others waiting
    for it): it is raised as a RuntimeError."""
    first, last = dist.run(2, _fit_failing, error)
    words = "a bug in the user's loss code" if error is ValueError else \
        "StopIteration raised inside the pipelined training step (stage 1): StopIteration(\"a bug in the user's loss code\")"
    kind = "ValueError" if error is ValueError else "RuntimeError"
    assert last[:2] == (kind, words) and last[2] == [], last
    assert lost_peer(RuntimeError(first[1])), first  # gloo's own words stay the error
    assert len(first[2]) == 1 and f"global rank 1 (pipeline rank 1 of 2) raised {kind}: {words}" in first[2][0] \
        and "global rank 0 (pipeline rank 0 of 2)" in first[2][0], first
    assert "timed out" not in first[1].lower() and "timeout" not in first[1].lower(), first  # its peer's exit, not the
    # 60 s timeout, ended the wait (its words say which; no assertion on the time itself)


class StopAt(L.Callback):
    """Global rank 1 stops itself (SIGSTOP: alive, silent) as step 2 begins."""

    def on_train_batch_start(self, trainer, *args):
        if trainer.global_step == 2 and trainer.global_rank == 1:
            import os
            import signal

            os.kill(os.getpid(), signal.SIGSTOP)


def _fit_stopping(rank, world):
    t0 = time.monotonic()
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=MegaStrategy(pp=2, microbatches=2, timeout=15),
                        max_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, use_distributed_sampler=False,
                        callbacks=[StopAt()])
    try:
        trainer.fit(Net(), net_loader())
    except Exception as err:  # noqa: BLE001 - returned to the test
        return type(err).__name__, str(err), getattr(err, "__notes__", []), time.monotonic() - t0
    return None


def test_a_stopped_rank_is_named_by_its_silent_heartbeat_when_the_others_time_out(tmp_path):
    """A hung rank notes no error: the others' collective times out (MegaStrategy(timeout=15)), and their
    error says which rank went silent, on which host, since which step."""
    import os
    import signal

    ctx = dist.start(2, _fit_stopping, str(tmp_path))
    deadline = time.monotonic() + 180
    try:
        while not (tmp_path / "0.pt").exists() and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        for p in ctx.processes:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
    got = dist.result(tmp_path / "0.pt")["ok"]
    kind, text, notes, seconds = got
    assert lost_peer(RuntimeError(text)), got
    assert len(notes) == 1 and "global rank 1 (host " in notes[0] and "sent no heartbeat for" in notes[0] \
        and "(its last: beginning step 1)" in notes[0], got  # it stopped as the next step began


def test_the_watcher_stops_a_rank_whose_next_rank_is_silent_for_hang_seconds_but_not_one_that_ended(monkeypatch):
    """Rank 0 watches rank 1: an unchanged heartbeat for longer than ``hang`` (by rank 0's clock) gives the note
    that stops every rank (written for the others too); a heartbeat that changes, or "done", never does."""
    import json as _json

    from lightning_tp.faults import notes as failures

    store, clock = torch.distributed.HashStore(), [100.0]
    monkeypatch.setattr(failures.time, "monotonic", lambda: clock[0])
    watcher = FailureNotes(store, "global rank 0", rank=0, world=2, hang=10.0)
    other = FailureNotes(store, "global rank 1", rank=1, world=2, hang=10.0)
    other.prefix = watcher.prefix
    key = f"{watcher.prefix}/alive/1"
    assert watcher._watch() is None  # no heartbeat yet: not started, not silent
    store.set(key, _json.dumps([1.0, 3, "elsewhere", 1]))
    assert watcher._watch() is None
    for t in (105.0, 110.0):
        clock[0] = t
        assert watcher._watch() is None  # unchanged for 5 s, then 10 s: not over hang
    store.set(key, _json.dumps([2.0, 4, "elsewhere", 1]))  # it beat again
    clock[0] = 119.0
    assert watcher._watch() is None
    clock[0] = 129.5
    note = watcher._watch()
    assert note and "global rank 1 (host elsewhere) sent no heartbeat for 10 s (its last: beginning step 4)" in note
    assert other._watch() == note  # the others read it and stop too
    ended = FailureNotes(store, "global rank 0", rank=0, world=2, hang=10.0)
    store.set(f"{ended.prefix}/alive/1", "done")
    clock[0] = 1000.0
    assert ended._watch() is None and ended._watch() is None
    with pytest.raises(ValueError, match="hang_timeout=0"):
        MegaStrategy(hang_timeout=0)


def _init_only(rank, world):
    torch.distributed.init_process_group("gloo")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return rank


def test_a_launch_whose_port_was_taken_starts_again_on_another(monkeypatch):
    """run_local: a port another process took after free_port() gave it (EADDRINUSE at the store's bind) is
    launched again on another, not reported as the caller's failure."""
    import socket

    from lightning_tp.testing import launch

    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    ports, real = iter([held.getsockname()[1]]), launch.free_port
    monkeypatch.setattr(launch, "free_port", lambda: next(ports, None) or real())
    try:
        assert launch.run_local(2, _init_only, timeout=120, preload=dist.PRELOAD) == [0, 1]
    finally:
        held.close()
