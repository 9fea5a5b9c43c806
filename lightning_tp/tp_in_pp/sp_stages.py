"""Sequence parallelism in an encoder-decoder's pipeline stages: split and gather act only where their block
runs for real; a stage receiving inside a stack gets sequence shards. See docs/design/pipeline-tp-in-pp.md.
"""

from __future__ import annotations

from functools import partial

import torch


def chain_index(layout, path: str):
    """The chain index of the block at ``path`` ('model.encoder.layers.0'), or for a stack holding a
    block list ('model.encoder') its last block's: where its output is made. None elsewhere."""
    start = 0
    for lpath, n in layout.lists:
        if path.startswith(lpath + "."):
            head = path[len(lpath) + 1:].split(".")[0]
            return start + int(head) if head.isdigit() else None
        if lpath.startswith(path + "."):
            return start + n - 1
        start += n
    return None


def runs_here(stage, indices: dict, path: str) -> bool:
    """Whether the module at ``path`` runs for real in the current run (its block is in the running
    virtual stage's range); True for a module outside the blocks."""
    i = indices.get(path)
    if i is None:
        return True
    vstage = stage.replay[0] if stage.replay is not None else stage.run.vstage  # a backward's recompute: its stage
    lo, hi = stage.ranges[vstage]
    return lo <= i <= hi


def install(layout, stage, matches, contexts, tp: int) -> None:
    """Gate each SP context's split and gather by the running stage, and tell the stages the hidden
    states they receive are sequence shards (see ..pipeline.run.stage_chained.wrap_chained)."""
    sp = [ctx for ctx in contexts if ctx.sp]
    if not sp or not layout.lists:
        return
    paths = [p for m in matches for p in m.sp_starts() + m.sp_ends()]
    indices = {p: chain_index(layout, p) for p in paths}
    for ctx in sp:
        ctx.here = partial(runs_here, stage, indices)
    stage.sp_shards, stage.seq_dim = tp, sp[0].seq_dim


def shard_like(t: torch.Tensor, shards: int, seq_dim: int) -> torch.Tensor:
    """A shape-only tensor like ``t`` with its sequence dimension split ``shards`` ways."""
    shape = list(t.shape)
    shape[seq_dim] //= shards
    return torch.empty(shape, dtype=t.dtype, device="meta")
