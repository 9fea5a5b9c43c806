"""Selective activation recomputation (Megatron's "selective"): each block's attention core (QKᵀ,
softmax, its dropout, the product with V) runs under a non-reentrant checkpoint, so its s² activations
are recomputed in backward instead of stored. See docs/design/rng-and-recompute.md."""

from __future__ import annotations

import functools
import sys
import types

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

CORE = ((F, "scaled_dot_product_attention"),)  # (namespace, name) of the functions that are the core


def _checkpointed(module: nn.Module, fn, *args, **kwargs):
    module._lightning_tp_selective_hits += 1
    return checkpoint(fn, *args, use_reentrant=False, **kwargs)


def attention_modules(block: nn.Module) -> list:
    """The innermost submodules of ``block`` whose class name says attention (the block itself included)."""
    found = [m for m in block.modules() if "attention" in type(m).__name__.lower()]
    return [m for m in found if not any(o is not m and any(c is o for c in m.modules()) for o in found)]


def places(model: nn.Module, layout=None, pp_rank: int = 0, name=None) -> list:
    """(list path, index) of the blocks whose attention core is recomputed: this rank's stage's under a
    pipeline ``layout``, else every block of the model's lists; an error if none holds an attention module."""
    from .pipeline.cut.block_lists import block_at
    from .recompute import block_lists

    if layout is not None:
        out = [layout.locate(i) for k in layout.vstages_of(pp_rank)
               for i in range(layout.ranges[k][0], layout.ranges[k][1] + 1)]
    else:
        out = [(path, i) for path in block_lists(model, name) for i in range(len(model.get_submodule(path)))]
    if out and not any(attention_modules(block_at(model.get_submodule(p), i)) for p, i in out):
        raise ValueError(f"MegaStrategy(activation_checkpointing='selective') recomputes each block's attention "
                         f"core, but no module whose class name says attention is in {type(model).__name__}'s "
                         f"blocks. Use activation_checkpointing=True (whole blocks).")
    return out


def blocks_at(model: nn.Module, places: list) -> list:
    """The block modules (each part a block's call runs) at ``places``."""
    from .pipeline.cut.block_lists import block_at, called_parts

    return [part for path, i in places for _, part in called_parts(block_at(model.get_submodule(path), i))]


def apply(blocks: list, core=None) -> int:
    """Recompute the attention core of each block (``core``: (namespace, name) of the functions that are the
    core, default torch.nn.functional's scaled_dot_product_attention; Hugging Face's eager attention function
    is found per model family); returns how many attention modules were wrapped."""
    n = 0
    for block in blocks:
        for attn in attention_modules(block):
            if getattr(attn, "_lightning_tp_selective", False):
                continue
            _wrap_eager(attn)
            attn._lightning_tp_selective = True
            attn._lightning_tp_selective_core = tuple(core) if core else CORE
            attn._lightning_tp_selective_inner = attn.forward
            attn.forward = types.MethodType(_selective_forward, attn)
            n += 1
    return n


def _selective_forward(self, *args, **kwargs):
    """The module's forward with each core function, looked up by name in its namespace while it runs
    (torch.nn.functional's, as the example GPT, Hugging Face's sdpa path, litgpt and
    nn.MultiheadAttention call it), replaced by its checkpointed call."""
    if not torch.is_grad_enabled():
        return self._lightning_tp_selective_inner(*args, **kwargs)
    self._lightning_tp_selective_hits = 0
    saved = [(space, name, getattr(space, name)) for space, name in self._lightning_tp_selective_core]
    try:
        for space, name, fn in saved:
            setattr(space, name, functools.partial(_checkpointed, self, fn))
        out = self._lightning_tp_selective_inner(*args, **kwargs)
    finally:
        for space, name, fn in saved:
            setattr(space, name, fn)
    if not self._lightning_tp_selective_hits and not getattr(self, "_lightning_tp_selective_warned", False):
        from lightning.pytorch.utilities import rank_zero_warn

        self._lightning_tp_selective_warned = True
        rank_zero_warn(f"activation_checkpointing='selective': {type(self).__name__} computed its attention without "
                       f"scaled_dot_product_attention or its family's eager_attention_forward, so nothing in it is "
                       f"recomputed. Use activation_checkpointing=True for this model.")
    return out


def _wrap_eager(attn: nn.Module) -> None:
    """A Hugging Face family's ``eager_attention_forward`` (a Python function, not one torch call) under a
    checkpoint when the module it is given is marked selective (its module-level name, replaced once)."""
    module = sys.modules.get(type(attn).__module__)
    eager = getattr(module, "eager_attention_forward", None)
    if eager is None or getattr(eager, "_lightning_tp_selective", False):
        return

    def eager_attention_forward(mod, *args, **kwargs):
        if getattr(mod, "_lightning_tp_selective", False) and torch.is_grad_enabled():
            mod._lightning_tp_selective_hits = getattr(mod, "_lightning_tp_selective_hits", 0) + 1
            return checkpoint(eager, mod, *args, use_reentrant=False, **kwargs)
        return eager(mod, *args, **kwargs)

    eager_attention_forward._lightning_tp_selective = True
    module.eager_attention_forward = eager_attention_forward
