"""Make the user's forward run one virtual stage at a time.

Each block this rank owns gets a thin forward wrapper (an instance attribute, so module paths and
state-dict keys stay the same). While virtual stage k runs, blocks outside k's range pass their
input through, k's first block takes the activation received from stage k-1 instead of what the
user's code computed, and k's last block stops the user's step by raising :class:`StageDone`
with its output, unless k is the last stage, where the user's code runs on to the loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .split import zeros_like_output


class StageDone(Exception):
    """Carries the output of this virtual stage's last block out of the user's step."""

    def __init__(self, output):
        super().__init__("pipeline stage finished")
        self.output = output


@dataclass
class StageState:
    ranges: list  # per virtual stage (first, last) block index
    last_vstage: int
    active: int = 0
    received: torch.Tensor | None = None


def install(blocks, layout, pp_rank: int, before=()) -> StageState:
    """``before``: (module, meta twin) pairs of first-stage modules to silence in later chunks."""
    state = StageState(layout.ranges, layout.last_vstage)
    for k in layout.vstages_of(pp_rank):
        lo, hi = layout.ranges[k]
        for i in range(lo, hi + 1):
            _wrap(blocks[i], i, state)
    for module, twin in before:
        _wrap_first_stage_module(module, twin, state)
    return state


def _wrap_first_stage_module(module, twin, state: StageState) -> None:
    """An embedding only feeds virtual stage 0: in a later chunk's run it returns zeros of its shape."""
    original = module.forward

    def forward(*args, **kwargs):
        if state.active > 0:
            return zeros_like_output(twin, args, kwargs)
        return original(*args, **kwargs)

    module.forward = forward


def _wrap(block, index: int, state: StageState) -> None:
    original = block.forward

    def forward(*args, **kwargs):
        lo, hi = state.ranges[state.active]
        if not lo <= index <= hi:
            return args[0] if args else next(iter(kwargs.values()))
        if index == lo and state.active > 0:
            if args:
                args = (state.received,) + tuple(args[1:])
            else:
                key = next(iter(kwargs))
                kwargs = {**kwargs, key: state.received}
        out = original(*args, **kwargs)
        if index == hi and state.active < state.last_vstage:
            raise StageDone(out if isinstance(out, torch.Tensor) else out[0])  # (hidden, ...) tuples
        return out

    block.forward = forward
