"""What a run really holds: the most CPU tensor bytes alive at once, from the profiler's memory events
(allocations made inside the ``with``), to check a plan's memory against. See docs/planner.md."""

from __future__ import annotations

import contextlib
import gc

from torch.profiler import ProfilerActivity, profile


@contextlib.contextmanager
def peak_memory():
    """Yield a dict whose ``"bytes"`` is, on exit, the peak of the CPU tensor bytes allocated in the body and
    alive at once (tensors made before it do not count)."""
    out = {"bytes": 0}
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield out
        gc.collect()
    out["bytes"] = _peak(prof.profiler.kineto_results.experimental_event_tree())


def _peak(nodes) -> int:
    """The most bytes alive at once, replaying the allocation events in time order (a pointer allocated again
    counts once: its free was made on a thread the profiler does not see, such as gloo's worker)."""
    from torch._C._profiler import _EventType

    events, stack = [], list(nodes)
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            events.append((node.start_time_ns, node.extra_fields.ptr, node.extra_fields.alloc_size))
        stack.extend(node.children)
    live, now, best = {}, 0, 0
    for _, ptr, size in sorted(events, key=lambda e: e[0]):
        now -= live.pop(ptr, 0)
        if size > 0:
            live[ptr] = size
            now += size
        best = max(best, now)
    return best


def saved_bytes():
    """A Lightning callback noting, per training step, the bytes of the distinct storages autograd saves in
    its forward for backward (parameters left out): ``.per_step``, a list of {storage: bytes}."""
    import lightning as L
    import torch

    class SavedBytes(L.Callback):
        def __init__(self):
            self.per_step, self._hooks = [], None

        def on_train_batch_start(self, trainer, pl_module, *args):
            params = {p.untyped_storage().data_ptr() for p in pl_module.parameters()}
            seen = {}

            def pack(t):
                ptr = t.untyped_storage().data_ptr()
                if ptr not in params:
                    seen[ptr] = t.untyped_storage().nbytes()
                return t

            self.per_step.append(seen)
            self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
            self._hooks.__enter__()

        def on_before_backward(self, *args):
            self._hooks.__exit__(None, None, None)

    return SavedBytes()
