"""Switch Transformers under a pipeline: its router losses need every MoE layer's router logits on the last stage,
and an encoder-decoder's stages do not carry them yet; its loss stops with what to set instead of failing
inside the model (transformers 5.x: ``torch.cat`` of nothing; 4.x: the stand-ins' NaN)."""

from __future__ import annotations

import functools

from torch import nn

from .families import SWITCH, find_moe_blocks


def refuse_router_losses(model: nn.Module) -> None:
    """Under pp: ``model``'s Switch Transformers loss refuses its router losses (4.x computes them by default)."""
    owner = next((m for m in model.modules() if hasattr(type(m), "_unpack_router_logits")), None)
    if owner is None or not any(family is SWITCH for _, _, family in find_moe_blocks(model)):
        return
    _patch(type(owner))
    owner._lightning_tp_pipelined = True


def _patch(cls) -> None:
    original = cls._unpack_router_logits
    if getattr(original, "_lightning_tp", False):
        return

    @functools.wraps(original)
    def _unpack_router_logits(self, router_outputs):
        if getattr(self, "_lightning_tp_pipelined", False):
            raise ValueError(f"MegaStrategy(pp > 1): {type(self).__name__}'s router z-loss and load-balancing loss "
                             f"need every MoE layer's router logits on the last stage, which an encoder-decoder's "
                             f"stages do not carry yet. Pass output_router_logits=False to the model under pp "
                             f"(transformers 4.x computes them by default), or use tp/dp/ep.")
        return original(self, router_outputs)

    _unpack_router_logits._lightning_tp = True
    cls._unpack_router_logits = _unpack_router_logits
