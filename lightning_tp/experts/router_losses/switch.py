"""Switch Transformers' router losses under a pipeline: the model's own loss takes each stack's router logits of
every MoE layer, the earlier stages' carried behind the activations (see .carry), this stage's its own."""

from __future__ import annotations

import functools
import sys

import torch
import torch.nn.functional as F
from torch import nn


class StackLogits(tuple):
    """A stack's recorded router outputs, tagged with the stack and the carry that makes them whole."""


def install(model: nn.Module, carry, lists: list, blocks: list) -> None:
    """Tag what each stack of ``model`` (``lists``: its encoder's and decoder's block lists) returns as its router
    outputs, and let the model's ``_unpack_router_logits`` read a tagged one from ``carry``; ``blocks``: this
    rank's Switch blocks."""
    owner = _owner(model)
    if owner is None:
        return
    _patch(type(owner))
    for stack, path in zip(("encoder", "decoder"), lists):
        module = model.get_submodule(path.rpartition(".")[0])
        for block in module.modules():
            if any(block is b for b in blocks):
                block._lightning_tp_stack = stack
        module.register_forward_hook(functools.partial(_tag, stack, carry))


def _owner(model: nn.Module):
    return next((m for m in model.modules() if hasattr(type(m), "_unpack_router_logits")), None)


def _tag(stack: str, carry, module, args, out):
    """A stack's output with its router outputs (5.x ``router_logits``, 4.x ``router_probs``) tagged."""
    for field in ("router_logits", "router_probs"):
        value = out.get(field) if hasattr(out, "get") else None
        if value is not None:
            tagged = StackLogits(value)
            tagged.stack, tagged.carry = stack, carry
            out[field] = tagged
    return out


def _patch(cls) -> None:
    """``cls._unpack_router_logits`` reading a tagged stack's logits whole (transformers 4.x: each with the expert
    index its router's capacity kept, as the router returned it)."""
    original = cls._unpack_router_logits
    if getattr(original, "_lightning_tp", False):
        return
    pairs = not hasattr(sys.modules[cls.__module__], "SwitchTransformersExperts")  # 4.x: (logits, index) per layer

    @functools.wraps(original)
    def _unpack_router_logits(self, router_outputs):
        carry = getattr(router_outputs, "carry", None)
        if carry is None:
            return original(self, router_outputs)
        logits = carry.stack_logits(router_outputs.stack)
        capacity = self.config.expert_capacity
        return original(self, tuple((g, _kept_index(g, capacity)) for g in logits) if pairs else tuple(logits))

    _unpack_router_logits._lightning_tp = True
    cls._unpack_router_logits = _unpack_router_logits


def _kept_index(logits: torch.Tensor, capacity: int) -> torch.Tensor:
    """Each token's expert as Switch's router reports it: its top expert where within that expert's capacity
    (counted along the sequence), else 0."""
    one = F.one_hot(logits.argmax(-1), logits.shape[-1])
    return (one * (torch.cumsum(one, dim=-2) <= capacity)).argmax(-1)
