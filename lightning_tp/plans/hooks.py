"""The forward hooks a plan installs: where sequence parallelism begins and ends, a region's inputs
entering tp, and the outputs and logits gathered whole for the user's code. See docs/design/plans.md."""

from __future__ import annotations

import inspect
from functools import partial

import torch
from torch.utils._pytree import tree_map

from .. import comm
from ..layers import TPContext
from .lookup import Match, module_at


def whole_outputs(ctx: TPContext):
    """A forward hook gathering the hidden states and attention maps a module returning Hugging Face's
    outputs collects, so the user's code sees them whole. See docs/design/plans.md."""
    def hook(module, args, output):
        hidden = getattr(output, "hidden_states", None)
        if hidden is not None and ctx.sp_now():  # shards: 1/tp of the length SP started with
            output.hidden_states = tuple(comm.gather_to_full_sp(h, ctx.group, ctx.seq_dim)
                                         if isinstance(h, torch.Tensor) and h.shape[ctx.seq_dim] * ctx.world == ctx.seq_len
                                         else h for h in hidden)
        for name in ("attentions", "cross_attentions"):
            maps = getattr(output, name, None)
            if maps is not None and ctx.world > 1:  # (under pp, other stages' entries are no tensors)
                setattr(output, name, tuple(comm.gather_from_tp(a, ctx.group, 1) if isinstance(a, torch.Tensor)
                                            else a for a in maps))
        return output

    return hook


def whole_logits(head_path: str):
    """A forward hook gathering the logits a 'vocab_ce' model returns to the user's code (its loss reads
    this rank's columns). See docs/design/plans.md."""
    def hook(module, args, output):
        head = module.get_submodule(head_path)
        ref = head.__dict__.get("_shards")
        shards = ref() if ref is not None else None
        if shards is None:
            return None
        head._shards = None
        return tree_map(lambda t: head.gather(t) if t is shards else t, output)

    return hook


def first_tensor_hook(fn):
    def hook(module, args, kwargs):
        if args:
            return (fn(args[0]),) + tuple(args[1:]), kwargs
        for key, value in kwargs.items():
            if hasattr(value, "dim"):
                return args, {**kwargs, key: fn(value)}
        return None
    return hook


def region_hook(fn, module, names, named_fn=None):
    """The first tensor argument enters the TP region, and each argument named in ``names``, given by
    keyword or at its place in the forward's signature: one entry for all the layers that read it
    (by ``named_fn``, where those are whole under SP; else by ``fn``)."""
    named_fn = named_fn or fn
    if not names:
        return first_tensor_hook(fn)
    params = list(inspect.signature(module.forward).parameters)
    where = {n: params.index(n) for n in names}

    def hook(mod, args, kwargs):
        args, kwargs = list(args), dict(kwargs)
        places = [("kw", n) if n in kwargs else ("pos", where[n]) for n in names]
        named_positions = {i for kind, i in places if kind == "pos"}
        first = next((("pos", i) for i, a in enumerate(args) if i not in named_positions and torch.is_tensor(a)),
                     None) or next((("kw", k) for k, v in kwargs.items() if k not in names and torch.is_tensor(v)),
                                   None)
        for kind, key in dict.fromkeys(([first] if first else []) + places):  # each place once
            held = kwargs if kind == "kw" else args
            if (kind == "kw" or key < len(args)) and torch.is_tensor(held[key]):
                held[key] = (fn if (kind, key) == first else named_fn)(held[key])
        return tuple(args), kwargs
    return hook


def install_sp_boundaries(model, m: Match, ctx: TPContext) -> None:
    """SP begins at ``sp_start`` (the sequence is split) and ends at ``sp_end`` (gathered), decided per
    forward. See docs/design/plans.md."""
    def enter(x, path):
        if ctx.here is not None and not ctx.here(path):  # a stand-in for another stage's block: whole
            return x
        n = ctx.seq_len = x.shape[ctx.seq_dim]
        if n % ctx.world and (torch.is_grad_enabled() or not ctx.sp_fallback):
            why = ("in training every rank needs an equal shard" if ctx.sp_fallback else
                   "under pp the later stages expect shards")
            raise ValueError(f"sequence parallelism (sp=True): {path or 'the model'} is given a sequence of {n}, which "
                             f"tp={ctx.world} does not divide, and {why}. Pad sequences to a multiple of "
                             f"{ctx.world}" + (" (forwards without grad, such as validation or generation, take "
                                               "any length)" if ctx.sp_fallback else "") + ", or set sp=False.")
        ctx.whole = n % ctx.world != 0
        return x if ctx.whole else comm.scatter_to_sp(x, ctx.group, ctx.seq_dim)

    def leave(module, args, output, path):
        if not ctx.sp_now() or (ctx.here is not None and not ctx.here(path)):
            return output
        if isinstance(getattr(output, "last_hidden_state", None), torch.Tensor):  # a Hugging Face stack's output
            output.last_hidden_state = comm.gather_to_full_sp(output.last_hidden_state, ctx.group, ctx.seq_dim)
            return output
        if isinstance(output, tuple):
            return (comm.gather_to_full_sp(output[0], ctx.group, ctx.seq_dim),) + output[1:]
        return comm.gather_to_full_sp(output, ctx.group, ctx.seq_dim)

    for path in m.sp_starts() or ("",):  # several: each sequence's (their regions must not overlap)
        start = module_at(model, path) if path else model
        if start is not None:
            start.register_forward_pre_hook(first_tensor_hook(partial(enter, path=path)), with_kwargs=True)
    for path in m.sp_ends():
        end = module_at(model, path) if path else model
        if end is not None:
            end.register_forward_hook(partial(leave, path=path))
