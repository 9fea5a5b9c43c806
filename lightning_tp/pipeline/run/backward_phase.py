"""Which half of a pipeline's split backward runs now: "B" (input gradients), "W" (weight gradients) or
None (a plain backward); and :func:`halves`, with which this project's custom autograd Functions give
each half only its own work. See docs/design/pipeline-run.md (split backward)."""

from __future__ import annotations

import contextlib

_PHASE = [None, (), False]  # the half, B's input leaves, whether B takes weight gradients too
# weight gradients B kept for W; W computing one B left (alone); W re-running input work with it (tests)
COUNTS = {"kept": 0, "deferred": 0, "inputs_again": 0}


def phase():
    """"B", "W" or None (see the module docstring)."""
    return _PHASE[0]


def input_leaves() -> tuple:
    """In B: the leaves whose gradient it computes (the engine captures them, it runs no node there)."""
    return _PHASE[1]


@contextlib.contextmanager
def in_phase(name: str, inputs=(), with_weights: bool = False):
    """Run a backward call as half ``name``; ``with_weights``: B also takes some weights' gradients."""
    before, _PHASE[:] = list(_PHASE), [name, tuple(inputs), with_weights]
    try:
        yield
    finally:
        _PHASE[:] = before


def halves(ctx, grads_of, n: int, weights: tuple, joint: bool):
    """A Function's backward by half: ``grads_of(wanted)`` returns its ``n`` gradients (at least those whose
    index is ``wanted``); B keeps what it computed of the ``weights`` for W, which returns them; ``joint``:
    ``grads_of`` cannot compute the weights' without the inputs' (W without kept ones counts a re-run)."""
    now = _PHASE[0]
    if now == "W" and not hasattr(ctx, "_lightning_tp_kept"):  # weight-side work B never ran: all of it is W's
        return grads_of(set(range(n)))
    if now == "W":
        kept = ctx._lightning_tp_kept
        del ctx._lightning_tp_kept
        missing = {i for i in weights if i not in kept}
        if missing:
            COUNTS["inputs_again" if joint else "deferred"] += 1
            fresh = grads_of(missing)
            kept.update({i: fresh[i] for i in missing})
        return tuple(kept[i] if i in weights else None for i in range(n))
    grads = grads_of(set(range(n)) if now is None or _PHASE[2] or joint else set(range(n)) - set(weights))
    if now != "B":
        return grads
    ctx._lightning_tp_kept = kept = {i: grads[i] for i in weights if grads[i] is not None}
    COUNTS["kept"] += len(kept)
    return tuple(None if i in weights and not _PHASE[2] else g for i, g in enumerate(grads))
