"""Sends issued from a thread of their own (gloo).

A gloo ``isend`` whose receive is already posted writes the payload to the socket in the calling
thread: 0.1-0.3 ms on a CPU box, spent between a stage's computation and its next one, on every
transfer. Handed to a thread, the call costs the step's thread a queue put (~0.01 ms) and the write
overlaps the next computation (torch ops and ``isend`` itself run without the GIL). Sends leave in
the order they were handed over. The thread lives as long as its owner (one per pipeline runner)
and is a daemon, so it never holds up the interpreter's exit.
"""

from __future__ import annotations

import queue
import threading

import torch.distributed as dist


class SendThread:
    def __init__(self):
        self._queue: queue.Queue = queue.Queue()
        self.works: list = []  # (work, tensor) of the sends issued since the last drain(), in order
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="lightning_tp-p2p-send", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            tensor, dst, tag = self._queue.get()
            try:
                if self._error is None:  # after a failure, the rest is dropped (drain() raises)
                    self.works.append((dist.isend(tensor, dst, tag=tag), tensor))
            except BaseException as e:  # noqa: BLE001 - handed to the step's thread by drain()
                self._error = e
            finally:
                self._queue.task_done()

    def submit(self, tensor, dst: int, tag: int) -> None:
        """Send ``tensor`` (kept alive by the queue, then by its work) to ``dst``; returns at once."""
        self._queue.put((tensor, dst, tag))

    def drain(self) -> None:
        """Wait until every send handed over has completed; raise the first error any of them hit."""
        self._queue.join()
        works, self.works = self.works, []
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"a pipeline send failed: {error}") from error
        for work, _ in works:
            work.wait()
