"""A Hugging Face MoE family's load-balancing loss over the whole global batch: router logits (and the
attention mask) gathered over dp first, under a pipeline the earlier stages' logits put first (see
.carry). Installed per modeling module by :func:`install` (a Liger-style patch)."""

from __future__ import annotations

import functools
import sys

import torch

from ... import comm

_GROUPS: dict = {}  # modeling module name -> (dp group, pp) of the run that patched it
_CARRIES: dict = {}  # modeling module name -> the pipeline's RouterCarry (see .carry), under pp > 1


def install(block: torch.nn.Module, dp_group, pp: int) -> bool:
    """Patch the ``load_balancing_loss_func`` of ``block``'s modeling module (if it has one); True if patched."""
    return install_for(type(block).__module__, dp_group, pp)


def install_for(name: str, dp_group, pp: int) -> bool:
    """Patch the ``load_balancing_loss_func`` of modeling module ``name`` (if it has one); True if patched."""
    module = sys.modules.get(name)
    original = getattr(module, "load_balancing_loss_func", None)
    if original is None:
        return False
    _GROUPS[module.__name__] = (dp_group, pp)
    _CARRIES.pop(module.__name__, None)
    if not getattr(original, "_lightning_tp_global", False):
        module.load_balancing_loss_func = wrap(original, module.__name__)
    return True


def carry_for(name: str, carry) -> None:
    """Under a pipeline: the loss of modeling module ``name`` takes the earlier stages' logits from ``carry``."""
    _CARRIES[name] = carry


def wrap(original, name: str):
    """``original`` with its router logits and attention mask gathered over the dp group registered for ``name``."""
    @functools.wraps(original)
    def load_balancing_loss_func(gate_logits, *args, **kwargs):
        group, pp = _GROUPS.get(name, (None, 1))
        if isinstance(gate_logits, tuple) and gate_logits and pp > 1:
            if name not in _CARRIES:
                raise ValueError("MegaStrategy(pp > 1): the router's load-balancing loss needs every layer's router "
                                 "logits on the last stage, and the stages carry them only where the model's config "
                                 "asks for them: set config.output_router_logits=True rather than passing it to "
                                 "forward.")
            gate_logits = _CARRIES[name].whole(gate_logits)
        if isinstance(gate_logits, tuple) and comm.group_size(group) > 1:
            gate_logits = tuple(comm.gather_from_sp(g, group, dim=0) for g in gate_logits)
            mask = kwargs.get("attention_mask", args[2] if len(args) > 2 else None)
            if mask is not None:
                mask = comm.all_gather(mask, 0, group)
                if "attention_mask" in kwargs:
                    kwargs["attention_mask"] = mask
                else:
                    args = args[:2] + (mask,) + args[3:]
        return original(gate_logits, *args, **kwargs)

    load_balancing_loss_func._lightning_tp_global = True
    return load_balancing_loss_func
