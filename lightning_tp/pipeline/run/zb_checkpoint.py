"""Activation checkpointing that zero bubble can split: each block recomputes once, in B, and W uses that
recomputation (``MegaStrategy(schedule="zb_h1", zb_keep_recomputed=True)``). See
docs/design/pipeline-run.md.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.checkpoint import get_device_states, set_device_states

from . import zb


def checkpoint(run, block, args: tuple):
    """``run(*args)`` as one recomputed node; ``block``: the module whose trainable parameters it uses."""
    params = [p for p in block.parameters() if p.requires_grad]
    box = {}  # the output's structure and its non-tensor leaves, filled by the forward
    flat = _Recomputed.apply(run, box, len(params), *args, *params)
    if not isinstance(flat, tuple):
        flat = (flat,)
    tensors = iter(flat)
    leaves = [next(tensors) if is_tensor else value for is_tensor, value in box["leaves"]]
    return tree_unflatten(leaves, box["spec"])


class _Recomputed(torch.autograd.Function):
    splits_backward = True  # its backward does B's half, then W's (see .zb._fused)

    @staticmethod
    def forward(ctx, run, box, n_params, *flat):
        args = flat[:len(flat) - n_params]
        ctx.run, ctx.n_params = run, n_params
        ctx.device_type = next((a.device.type for a in args if torch.is_tensor(a) and a.device.type != "cpu"), "cpu")
        ctx.cpu_rng = torch.get_rng_state()
        ctx.devices, ctx.device_rng = get_device_states(*args) if ctx.device_type != "cpu" else ([], [])
        ctx.autocast = {t: dict(enabled=torch.is_autocast_enabled(t), dtype=torch.get_autocast_dtype(t))
                        for t in {"cpu", ctx.device_type} if torch.amp.is_autocast_available(t)}
        ctx.is_tensor = [torch.is_tensor(a) for a in args]
        ctx.others = [None if t else a for a, t in zip(args, ctx.is_tensor)]
        ctx.params = flat[len(args):]  # leaves: kept as they are, as the module keeps them
        ctx.save_for_backward(*(a for a in args if torch.is_tensor(a)))
        ctx.inner = ctx.kept = None
        with torch.no_grad():
            out = run(*args)
        leaves, box["spec"] = tree_flatten(out)
        box["leaves"] = [(torch.is_tensor(x), None if torch.is_tensor(x) else x) for x in leaves]
        return tuple(x for x in leaves if torch.is_tensor(x))

    @staticmethod
    def backward(ctx, *grads):
        skip = (None, None, None)  # run, box, n_params
        none_params = (None,) * ctx.n_params
        if zb.phase() == "W" and ctx.inner is not None:  # the weight half of what B recomputed
            inner, kept = ctx.inner, ctx.kept
            ctx.inner = ctx.kept = None
            inner.weight_grad()
            return skip + tuple(kept) + none_params
        args, outs = _recompute(ctx)
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        wanted = [i for i, a in enumerate(args) if torch.is_tensor(a) and a.requires_grad]
        inputs = [args[i] for i in wanted]
        params = list(ctx.params)
        arg_grads = [None] * len(args)
        if not pairs:  # nothing of the block's output reached: nothing to compute
            return skip + tuple(arg_grads) + none_params
        root, root_grad = _one_root(pairs)
        if zb.phase() == "B":
            inner = zb.SplitBackward(root, root_grad, inputs, params)
            for i, g in zip(wanted, inner.input_grad()):
                arg_grads[i] = g
            # an input whose node this backward call will not run (a weight-only branch): W hands
            # its gradient on, with the weight half
            edges = iter(ctx.next_functions)  # one per tensor argument, in order
            nodes = [next(edges)[0] if is_tensor else None for is_tensor in ctx.is_tensor]
            ctx.kept = [g if g is not None and node is not None and not _in_b(node) else None
                        for g, node in zip(arg_grads, nodes)]
            ctx.inner = inner
            return skip + tuple(arg_grads) + none_params
        got = torch.autograd.grad(root, inputs + params, root_grad, allow_unused=True)
        for i, g in zip(wanted, got):
            arg_grads[i] = g
        return skip + tuple(arg_grads) + tuple(got[len(inputs):])


def _in_b(node) -> bool:
    """Whether B's backward call runs ``node``, or, for a leaf's, captures its gradient."""
    leaf = getattr(node, "variable", None) if type(node).__name__ == "AccumulateGrad" else None
    if leaf is not None:
        return any(leaf is t for t in zb.input_leaves())
    return torch._C._will_engine_execute_node(node)


def _recompute(ctx):
    """The block's arguments as fresh leaves (requiring grad where the originals did) and its tensor
    outputs, recomputed with grad under the forward's random and autocast state."""
    tensors = iter(ctx.saved_tensors)
    args = [_fresh_leaf(next(tensors)) if is_tensor else other for is_tensor, other in zip(ctx.is_tensor, ctx.others)]
    with torch.random.fork_rng(devices=ctx.devices, device_type=ctx.device_type):
        torch.set_rng_state(ctx.cpu_rng)
        if ctx.devices:
            set_device_states(ctx.devices, ctx.device_rng, device_type=ctx.device_type)
        with torch.enable_grad(), _autocast(ctx.autocast):
            out = ctx.run(*args)
    return args, [x for x in tree_flatten(out)[0] if torch.is_tensor(x)]


def _fresh_leaf(t):
    return t.detach().requires_grad_(t.requires_grad)


def _autocast(states: dict):
    stack = contextlib.ExitStack()
    for device_type, state in states.items():
        stack.enter_context(torch.amp.autocast(device_type, **state))
    return stack


def _one_root(pairs):
    """(root, its gradient) for a backward from several outputs at once: the one output itself, or
    the sum of ``(output * grad).sum()`` (whose gradient for each output is exactly its grad)."""
    if len(pairs) == 1:
        return pairs[0]
    with torch.enable_grad():  # a backward runs without grad mode
        return sum((o * g).sum() for o, g in pairs), None
