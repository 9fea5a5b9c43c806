"""When one rank fails, say why on the others: each rank's error is noted in the process group's store
and added to the exception of a rank that lost its peer; a rank that stopped or hung, noting nothing, is
named by its heartbeat going quiet. See docs/design/failures.md and docs/fault-tolerance.md."""

from __future__ import annotations

import itertools
import json
import os
import signal
import socket
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

_LOST_PEER = ("connection closed by peer", "connection reset by peer", "broken pipe", "timed out waiting",  # gloo
              "socket timeout", "application timeout caused pair closure",
              # NCCL: the watchdog's timeout, an aborted communicator, a peer that exited (ncclRemoteError)
              "watchdog caught collective operation timeout", "communicator was aborted",
              "remote process exited", "remote process exiting", "ncclremoteerror")
_runs = itertools.count()  # one key set per Trainer entry (fit, validate, ...), made alike on every rank
_NOTE_CHARS = 4000


def lost_peer(exc: BaseException) -> bool:
    """Whether the error is a transfer or collective failing because another rank went away."""
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(words in text for words in _LOST_PEER)


def where(mesh) -> str:
    """This rank in words: its global rank and the coordinates of the layout's parallel sizes > 1."""
    parts = [f"{name} rank {rank} of {size}" for name, rank, size in
             (("pipeline", mesh.pp_rank, mesh.pp), ("tp", mesh.tp_rank, mesh.tp), ("dp", mesh.dp_rank, mesh.dp))
             if size > 1]
    return f"global rank {mesh.rank}" + (f" ({', '.join(parts)})" if parts else "")


class FailureNotes:
    """``where``: this rank in words (global rank, stage, tp/dp rank), for the others' tracebacks; with
    ``beat`` seconds, a heartbeat (time, ``step``, host) in the store until :meth:`close`; with ``hang`` seconds
    too, the next rank's heartbeat watched: silent that long, every rank is stopped, naming it."""

    def __init__(self, store, where: str, wait: float = 2.0, rank: int = 0, world: int = 1, beat: float = 0.0,
                 hang: float | None = None):
        self.store, self.where, self.wait = store, where, timedelta(seconds=wait)
        self.prefix = f"lightning_tp/failed/{next(_runs)}"
        self.rank, self.world, self.beat, self.step, self.hang = rank, world, beat, -1, hang
        self._seen = (None, time.monotonic())  # the watched rank's last heartbeat, and when it was new here
        self._stop, self._thread = threading.Event(), None
        if beat:
            self._beat()
            self._thread = threading.Thread(target=self._beating, name="lightning_tp heartbeat", daemon=True)
            self._thread.start()

    @classmethod
    def open(cls, mesh, beat: float = 5.0, hang: float | None = None):
        """Over the default process group's store, or None without one (every rank calls this once per
        Trainer entry, in the same order: the key numbers agree)."""
        try:
            store = dist.distributed_c10d._get_default_store()
        except (RuntimeError, ValueError):
            return None
        return cls(store, where(mesh), rank=mesh.rank, world=mesh.world_size, beat=beat, hang=hang)

    def _beat(self) -> None:
        self.store.set(f"{self.prefix}/alive/{self.rank}",
                       json.dumps([time.time(), self.step, socket.gethostname(), os.getpid()]))

    def _beating(self) -> None:
        while not self._stop.wait(self.beat):
            try:
                self._beat()
                verdict = self._watch() if self.hang else None
            except Exception:  # the store is gone: the run is ending
                return
            if verdict and not self._stop.is_set():
                print(f"lightning_tp: {verdict}\n(this rank, {self.where}, stops: MegaStrategy(hang_timeout="
                      f"{self.hang:g}))", file=sys.stderr, flush=True)
                os._exit(1)  # the main thread may sit in a collective for the whole timeout; the launcher restarts

    def _watch(self):
        """The note that stops this rank, if any: one already written by another rank's watcher, or the next rank
        silent for ``hang`` seconds (its heartbeat unchanged, by this rank's clock)."""
        stop = f"{self.prefix}/stop"
        if self.store.check([stop]):
            return self.store.get(stop).decode(errors="replace")
        nxt = (self.rank + 1) % self.world
        key = f"{self.prefix}/alive/{nxt}"
        if nxt == self.rank or not self.store.check([key]):
            return None
        beat, now = self.store.get(key), time.monotonic()
        if beat != self._seen[0] or beat == b"done":
            self._seen = (beat, now)
            return None
        if now - self._seen[1] <= self.hang:
            return None
        _, step, host, pid = json.loads(beat.decode())
        note = _quiet_note_of([(nxt, now - self._seen[1], step, host)])
        self.store.set(stop, note)
        if host == socket.gethostname():  # a stopped process on this host: ended now, not after the launcher's
            try:                          # grace period (SIGTERM stays pending on a stopped process)
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        return note

    def at_step(self, step: int) -> None:
        """This rank begins ``step``: said in the store now (what a silent rank was doing)."""
        self.step = step
        if self.beat:
            try:
                self._beat()
            except Exception:  # the store is gone: the run is ending
                pass

    def close(self) -> None:
        """Stop the heartbeat, and wait for a store call it may be in: a process must not exit, and destroy the
        store, under a thread still using it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=max(10.0, 2 * self.wait.total_seconds()))
            self._thread = None
        if self.beat:
            try:
                self.store.set(f"{self.prefix}/alive/{self.rank}", "done")  # ended, not silent
            except Exception:  # the store is gone: the run is ending
                pass

    def _quiet_note(self):
        try:
            quiet = self.quiet() if self.beat else []
        except Exception:  # the store went with the failing process
            return None
        return _quiet_note_of(quiet) if quiet else None

    def quiet(self, now: float | None = None) -> list:
        """(rank, seconds since its last heartbeat, its step then, its host) of each other rank silent for
        over two beats: stopped, hung, or gone."""
        now, out = now or time.time(), []
        for r in range(self.world):
            key = f"{self.prefix}/alive/{r}"
            if r == self.rank or not self.store.check([key]):
                continue
            beat = self.store.get(key)
            if beat == b"done":
                continue
            at, step, host = json.loads(beat.decode())[:3]
            if now - at > 2 * self.beat:
                out.append((r, now - at, step, host))
        return out

    def record(self, exc: BaseException) -> None:
        """On a failing rank, before it exits: note its error, unless another rank's was noted first or
        its own is a lost peer (a consequence: it would hide the cause)."""
        if not isinstance(exc, Exception) or lost_peer(exc):
            return
        try:
            if self.store.add(f"{self.prefix}/count", 1) == 1:
                note = f"{self.where} raised {type(exc).__name__}: {exc}"
                self.store.set(f"{self.prefix}/note", note[:_NOTE_CHARS])
        except Exception:  # the store is gone or unreachable: nothing to tell
            pass

    def explain(self, exc: BaseException) -> None:
        """On a rank whose error is a lost peer: add the first noted error to it."""
        if not lost_peer(exc):
            return
        key = f"{self.prefix}/note"
        try:
            self.store.wait([key], self.wait)
            note = self.store.get(key).decode(errors="replace")
        except Exception:  # none noted (the peer was killed or hung), or the store went with the failing process
            note = self._quiet_note()
            if note is None:
                return
        note = f"lightning_tp: {note}\n(this rank, {self.where}, stopped waiting for it)"
        if hasattr(exc, "add_note"):
            exc.add_note(note)
        else:  # Python 3.10: no notes; the message itself carries it
            exc.args = (f"{exc.args[0] if exc.args else ''}\n{note}",) + tuple(exc.args[1:])


def _quiet_note_of(quiet: list) -> str:
    return "; ".join(f"global rank {r} (host {host}) sent no heartbeat for {age:.0f} s (its last: beginning step "
                     f"{step}): stopped, hung or killed" for r, age, step, host in quiet)


def raise_on_every_rank(what: str, fn, rank: int, device, stage: int | None = None) -> None:
    """Run ``fn``; where it raises on one rank, raise on all (the others would wait in their first
    collective). ``stage``: this rank's pipeline stage under pp, where a stage whose modules are all
    frozen gets no trainable parameter."""
    error = None
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - re-raised below, on every rank
        error = e
    failed = -1
    if dist.is_available() and dist.is_initialized():
        flag = torch.tensor([-1 if error is None else rank], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        failed = int(flag.item())
    if error is not None:
        if stage is not None and "empty parameter list" in str(error):
            raise ValueError(f"{what} on pipeline stage {stage} gave the optimizer no parameter: every parameter "
                             f"this stage holds is frozen (each stage's self.parameters() holds only its own). "
                             f"Give it self.parameters() unfiltered: frozen ones get no gradient and are not "
                             f"stepped.") from error
        raise error
    if failed >= 0:
        raise RuntimeError(f"{what} failed on rank {failed} (its error is raised there); stopping every rank.")
