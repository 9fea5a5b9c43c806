"""The planned modules replaced in place by the parallel layers, holding this rank's shards of the
user's own weights. See docs/design/plans.md."""

from __future__ import annotations

import dataclasses
from collections import defaultdict

from torch import nn

from ..layers import (ColumnParallelLinear, RowParallelLinear, TPContext, TPMultiheadAttention,
                      VocabParallelCrossEntropy, VocabParallelEmbedding)
from ..layers.linear import shard_param
from ..layers.shard import ShardSpec, mark
from ..pipeline.cut.placeholders import PipelinePlaceholder
from .base import as_tuple, path_matches
from .hooks import install_sp_boundaries, region_hook, whole_logits, whole_outputs
from .lookup import join, module_at
from .sizes import head_replicas, set_attrs


def apply(model: nn.Module, matches: list, group, tp: int, rank: int, sp: bool, sp_fallback: bool = True) -> dict:
    """Replace the planned modules in place; returns {path: new module}. A module held under several paths
    (T5's ``shared``) is replaced under all; ``sp_fallback``: see TPContext (False under a pipeline)."""
    memo, replaced, aliases = {}, {}, defaultdict(list)
    for name, module in model.named_modules(remove_duplicate=False):
        aliases[id(module)].append(name)
    for m in matches:
        ctx = TPContext(group=group, world=tp, rank=rank, sp=sp and m.sp_start is not None, seq_dim=m.plan.seq_dim,
                        sp_fallback=sp_fallback)
        has_ce = any(style == "vocab_ce" for _, style, _ in m.entries)
        head, head_elsewhere = None, False
        for path, style, options in m.entries:
            module = module_at(model, path)
            if module is None:  # on another pipeline stage
                head_elsewhere = head_elsewhere or style == "lm_head"
                continue
            if style == "vocab_ce" and head_elsewhere:
                continue  # the loss only runs on the stage that holds the head
            local_ctx = dataclasses.replace(ctx, sp=False) if options.get("full_input") and ctx.sp else ctx
            new = _build(module, style, local_ctx, path, memo, has_ce, head, options)
            if style == "lm_head":
                head = new
            if new is not module:
                for alias in aliases[id(module)] or [path]:
                    model.set_submodule(alias, new)
                replaced[path] = new
        root = model.get_submodule(m.prefix) if m.prefix else model
        for glob, rules in m.plan.attrs.items():
            for name, module in root.named_modules():
                if path_matches(glob, name) and not isinstance(module, PipelinePlaceholder):
                    set_attrs(module, rules, tp)
        if ctx.sp:
            install_sp_boundaries(model, m, ctx)
        for held in (module_at(model, join(m.prefix, path)) for path in as_tuple(m.plan.outputs)):
            if held is not None:  # (after the sp_end's hook on the same module: see whole_outputs)
                held.register_forward_hook(whole_outputs(ctx))
        head_path, head_options = next(((p, o) for p, style, o in m.entries if style == "lm_head"), (None, {}))
        if has_ce and head is not None and not head_options.get("return_shards"):
            root.register_forward_hook(whole_logits(head_path[len(m.prefix) + 1:] if m.prefix else head_path))
    return replaced


def _build(module, style, ctx, path, memo, has_ce, head, options):
    split = dict(chunks=options.get("chunks", 1), sections=tuple(options.get("sections", ())))
    if style in ("colwise", "colwise_local"):
        split["replicas"] = head_replicas(module, options, ctx.world)
    if style == "colwise":
        return ColumnParallelLinear.from_linear(module, ctx, path, memo, gather_output=options.get("gather_output", False),
                                                **split)
    if style == "colwise_local":
        return ColumnParallelLinear.from_linear(module, ctx, path, memo, input_comm=False,
                                                gather_output=options.get("gather_output", False), **split)
    if style == "rowwise":
        return RowParallelLinear.from_linear(module, ctx, path, memo,
                                             input_is_parallel=not options.get("split_input", False))
    if style == "lm_head":
        gather = "eval" if has_ce else True
        return ColumnParallelLinear.from_linear(module, ctx, path, memo, gather_output=gather, pad=True)
    if style == "vocab":
        return VocabParallelEmbedding.from_embedding(module, ctx, path, memo)
    if style == "vocab_ce":
        return VocabParallelCrossEntropy.from_module(module, head, path) if head is not None else module
    if style == "mha":
        new = TPMultiheadAttention.from_module(module, ctx, path, memo)
        new.whole_memory = bool(options.get("whole_inputs"))
        return new
    if style == "embedding_cols":  # kept as it is, with this rank's columns: its lookups need no communication
        module.weight = shard_param(module.weight, ShardSpec(dim=1, world=ctx.world, full=module.embedding_dim),
                                     ctx, memo)
        module.embedding_dim = module.weight.shape[1]
        return module
    if style == "region":
        whole = ctx.enter_whole if options.get("whole_inputs") else ctx.enter_region
        hook = region_hook(ctx.enter_region, module, options.get("inputs", ()), whole)
        module.register_forward_pre_hook(hook, with_kwargs=True)
        for name in options.get("head_params", ()):  # one entry per head: this rank's heads' entries
            p = getattr(module, name)
            setattr(module, name, shard_param(p, ShardSpec(dim=0, world=ctx.world, full=p.shape[0]), ctx, memo))
        return module
    if style in ("sp_norm", "partial"):
        if ctx.sp or style == "partial":
            for p in module.parameters():
                mark(p, sp_partial=True)
        return module
    raise AssertionError(style)
