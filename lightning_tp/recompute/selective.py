"""Selective activation recomputation (Megatron's "selective"): each block's attention core (QKᵀ,
softmax, its dropout, the product with V) runs under a non-reentrant checkpoint, so its s² activations
are recomputed in backward instead of stored. See docs/design/rng-and-recompute.md."""

from __future__ import annotations

import fnmatch
import functools
import importlib
import os
import sys
import types

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend
from torch.utils.checkpoint import checkpoint

CORE = ((F, "scaled_dot_product_attention"),)  # (namespace, name) of the functions that are the core
_SDPA = F.scaled_dot_product_attention  # the function itself (the name is replaced while a core runs)


def _checkpointed(module: nn.Module, fn, *args, **kwargs):
    module._lightning_tp_selective_hits += 1
    if fn is _SDPA and not _keeps_scores(args, kwargs):
        return fn(*args, **kwargs)  # a fused kernel keeps no s x s scores: recomputing it would only cost time
    return checkpoint(fn, *args, use_reentrant=False, **kwargs)


def _keeps_scores(args, kwargs) -> bool:
    """Whether scaled_dot_product_attention would take its math path (which keeps the s x s probabilities)
    rather than a fused kernel; LIGHTNING_TP_SELECTIVE_FUSED=1 recomputes fused ones too (for tests)."""
    if os.environ.get("LIGHTNING_TP_SELECTIVE_FUSED") == "1":
        return True
    try:
        return int(torch._fused_sdp_choice(*args, **kwargs)) == int(SDPBackend.MATH)
    except (TypeError, RuntimeError, AttributeError):  # another torch: recompute, to be safe
        return True


def attention_modules(block: nn.Module) -> list:
    """The innermost submodules of ``block`` whose class name says attention (the block itself included)."""
    found = [m for m in block.modules() if "attention" in type(m).__name__.lower()]
    return [m for m in found if not any(o is not m and any(c is o for c in m.modules()) for o in found)]


def places(model: nn.Module, layout=None, pp_rank: int = 0, name=None, core: tuple = ()) -> list:
    """(list path, index) of the blocks whose attention core is recomputed: this rank's stage's under a
    pipeline ``layout``, else every block of the model's lists; an error if none holds an attention module
    (or, with a plan's ``core``, a module it names) or a named function does not exist."""
    from ..pipeline.cut.block_lists import block_at
    from .full import block_places

    out = block_places(model, layout, pp_rank, name)
    functions, globs = split_core(core)
    blocks = [block_at(model.get_submodule(p), i) for p, i in out]
    if globs and not any(_named(b, globs) for b in blocks):
        raise ValueError(f"MegaStrategy(activation_checkpointing='selective'): the plan's core {list(globs)} names no "
                         f"submodule of {type(model).__name__}'s blocks (paths are relative to a block).")
    if out and not globs and not functions and not any(attention_modules(b) for b in blocks):
        raise ValueError(f"MegaStrategy(activation_checkpointing='selective') recomputes each block's attention "
                         f"core, but no module whose class name says attention is in {type(model).__name__}'s "
                         f"blocks. Name the core in your plan (Plan(core='attn.core' or 'package.module:function')), "
                         f"or use activation_checkpointing=True (whole blocks).")
    return out


def split_core(core: tuple) -> tuple:
    """A plan's core entries as ((namespace, name) of functions, submodule globs); an unknown function is an error."""
    functions, globs = [], []
    for entry in core or ():
        if ":" in entry:
            where, _, name = entry.partition(":")
            try:
                space = importlib.import_module(where)
            except ImportError as e:
                raise ValueError(f"Plan(core={entry!r}): cannot import {where!r} ({e}).") from None
            if not callable(getattr(space, name, None)):
                raise ValueError(f"Plan(core={entry!r}): {where} has no function {name!r}.")
            functions.append((space, name))
        else:
            globs.append(entry)
    return tuple(functions), tuple(globs)


def _named(block: nn.Module, globs) -> list:
    return [m for n, m in block.named_modules() if n and any(fnmatch.fnmatchcase(n, g) for g in globs)]


def blocks_at(model: nn.Module, places: list) -> list:
    """The block modules (each part a block's call runs) at ``places``."""
    from ..pipeline.cut.block_lists import block_at, called_parts

    return [part for path, i in places for _, part in called_parts(block_at(model.get_submodule(path), i))]


def apply(blocks: list, core: tuple = ()) -> int:
    """Recompute the attention core of each block: SDPA, a Hugging Face family's eager attention, and the plan's
    ``core`` entries ('package.module:name' functions, or submodule globs relative to a block, checkpointed
    whole); returns how many modules were wrapped."""
    functions, globs = split_core(core)
    n = 0
    for block in blocks:
        for sub in _named(block, globs):
            if not getattr(sub, "_lightning_tp_selective", False):
                _checkpoint_module(sub)
                n += 1
        holders = [] if globs else attention_modules(block) or ([block] if functions else [])
        for attn in holders:  # a named function is replaced while they run (the whole block, if none is found)
            if getattr(attn, "_lightning_tp_selective", False):
                continue
            _wrap_eager(attn)
            attn._lightning_tp_selective = True
            attn._lightning_tp_selective_core = CORE + functions
            attn._lightning_tp_selective_inner = attn.forward
            attn.forward = types.MethodType(_selective_forward, attn)
            n += 1
    return n


def _checkpoint_module(sub: nn.Module) -> None:
    """A plan-named core module: its whole forward under a checkpoint."""
    inner = sub.forward
    sub._lightning_tp_selective, sub._lightning_tp_selective_hits = True, 0

    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        return _checkpointed(sub, inner, *args, **kwargs)

    sub.forward = forward


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
