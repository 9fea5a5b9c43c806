"""What a split backward takes in B, for :func:`lightning_tp.explain.explain`: one block of each class run
forward on a small tensor and its graph walked as .pipeline.run.zb walks a stage's. See docs/design/explain.md."""

from __future__ import annotations

import copy

import torch
from torch import nn

from .costs import width_in
from ..pipeline.cut.block_lists import block_at
from ..pipeline.run.zb import SplitBackward, whole_functions

SEQ = 4  # tokens of the probe's input: (1, SEQ, hidden)


def split_decisions(module: nn.Module, offset: dict, first: int, hidden: int) -> tuple[dict, dict]:
    """({block class: custom Functions taken in B}, {block class: weight groups deferred to W}) for the block lists
    ``offset`` ({path: chain index of its first block}) of ``module`` from chain index ``first`` on; a class whose
    block could not run alone maps to None in both (decided at the first step)."""
    in_b, deferred = {}, {}
    for path, start in offset.items():
        blocks = module.get_submodule(path)
        for j in range(max(0, first - start), len(blocks)):
            block = block_at(blocks, j)
            name = type(block).__name__
            if name not in in_b:
                in_b[name], deferred[name] = _probe(block, width_in(block) or hidden)
    return in_b, deferred


def _probe(block: nn.Module, hidden: int):
    """(Functions taken in B, groups deferred to W) of one block's backward, on a copy; (None, None) if it fails."""
    params = list(block.parameters())
    if not params or not hidden or any(p.is_meta for p in params):
        return None, None
    p = params[0]
    dtype = p.dtype if p.is_floating_point() else torch.get_default_dtype()
    try:
        with torch.random.fork_rng(devices=[p.device] if p.device.type == "cuda" else []), torch.enable_grad():
            local = copy.deepcopy(block)
            x = torch.linspace(-1, 1, SEQ * hidden, dtype=dtype, device=p.device).view(1, SEQ, hidden)
            x.requires_grad_()
            out = local(x)
            out = next((o for o in (out if isinstance(out, (tuple, list)) else (out,))
                        if isinstance(o, torch.Tensor)), None)
            if out is None or out.grad_fn is None:
                return None, None
            split = SplitBackward(out, torch.ones_like(out), x, list(local.parameters()))
    except Exception:  # the block needs more than its hidden states (masks, positions...): left to the run
        return None, None
    if split.whole:  # a compiled region: B runs the whole backward
        return ["CompiledFunctionBackward"], 0
    return whole_functions(split), len(split.groups)
