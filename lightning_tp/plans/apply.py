"""Find the plans for a model, check them (no communication), then swap in the parallel layers.
See docs/design/plans.md."""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn
from torch.utils._pytree import tree_map

from .. import comm
from ..layers import (ColumnParallelLinear, RowParallelLinear, TPContext, TPMultiheadAttention,
                      VocabParallelCrossEntropy, VocabParallelEmbedding)
from ..layers.linear import shard_param, is_conv1d
from ..layers.shard import ShardSpec, mark
from ..pipeline.cut.placeholders import PipelinePlaceholder
from ..experts.families import find_moe_blocks
from .base import Plan, as_tuple, path_matches, split_style
from .registry import registered_plans
from .sizes import check_attr, check_sizes, getattr_path, set_attrs, head_replicas

_EXPECTED = {
    "colwise": nn.Linear, "colwise_local": nn.Linear, "rowwise": nn.Linear, "lm_head": nn.Linear,
    "vocab": nn.Embedding, "embedding_cols": nn.Embedding, "vocab_ce": nn.CrossEntropyLoss,
    "mha": nn.MultiheadAttention,
}


@dataclass
class Match:
    """One plan applied at one place in the model, with its modules resolved."""

    prefix: str
    plan: Plan
    entries: list = field(default_factory=list)  # (full path, style)
    sp_start: str | tuple | None = None  # paths, one per sequence (see Plan.sp_start); None without SP
    sp_end: str | tuple | None = None  # the same (see Plan.sp_end)

    def sp_starts(self) -> tuple:
        return as_tuple(self.sp_start)

    def sp_ends(self) -> tuple:
        return as_tuple(self.sp_end)


def _join(prefix: str, path: str) -> str:
    return f"{prefix}.{path}" if prefix and path else prefix or path


def _find(model: nn.Module, plan, blocks_only: bool = False) -> list:
    """(prefix, Plan) of every module a plan covers. ``blocks_only``: the plans are read for their block
    list alone (pp at tp=1), which a family's plan gives without its styles (Phi-3's config plan has
    styles not supported at tp > 1)."""
    if plan is None or plan == "auto":
        found, taken = [], []
        for name, module in model.named_modules():
            if any(t == "" or name.startswith(t + ".") for t in taken):
                continue  # inside a module a plan already covers
            for candidate in registered_plans():
                if candidate.matches(module):
                    if blocks_only and hasattr(candidate, "blocks_of"):
                        found.append((name, Plan(name=candidate.name, blocks=candidate.blocks_of(module))))
                    else:
                        found.append((name, candidate.build(module) if hasattr(candidate, "build") else candidate))
                    taken.append(name)
                    break
        return found
    if isinstance(plan, dict):
        plan = Plan.from_dict(plan)
    if not isinstance(plan, Plan):
        raise TypeError(f"MegaStrategy(plan=...) takes 'auto', a lightning_tp.Plan or a dict, got {type(plan).__name__}.")
    return [("", plan)]


def _unplanned_types(model: nn.Module) -> list:
    holders = set()
    for _, module in model.named_modules():
        if any(isinstance(c, (nn.Linear, nn.Embedding, nn.MultiheadAttention)) for c in module.children()):
            holders.add(type(module).__name__)
    return sorted(holders)


def resolve(model: nn.Module, tp: int, sp: bool, plan="auto") -> list:
    """Match plans and check every size against tp. Raises ValueError with module names and numbers."""
    matches = []
    for prefix, p in _find(model, plan):
        root = model.get_submodule(prefix) if prefix else model
        m = Match(prefix, p)
        for name, module in root.named_modules():
            style, options = p.style_of(name)
            if style is None or style in ("replicate", "experts"):  # experts: run by experts/, not tp
                continue
            full = _join(prefix, name)
            expected = _EXPECTED.get(style)
            if expected is not None and not (isinstance(module, expected) or
                                             (expected is nn.Linear and is_conv1d(module))):
                raise ValueError(f"plan {p.name!r} gives {full} the style {style!r}, which needs a "
                                 f"{expected.__name__}, but it is a {type(module).__name__}.")
            check_sizes(full, module, style, tp, options)
            missing = [n for n in options.get("inputs", ()) if n not in inspect.signature(module.forward).parameters]
            if missing:
                raise ValueError(f"plan {p.name!r}: {full} is a 'region' entered by {missing}, which its forward "
                                 f"does not take.")
            m.entries.append((full, style, options))
        for glob, rules in p.attrs.items():
            for name, module in root.named_modules():
                if path_matches(glob, name):
                    for attr, rule in rules.items():
                        check_attr(_join(prefix, name), attr, getattr_path(module, attr), rule, tp)
        names = [n for n, _ in root.named_modules()]
        if p.sp_start is not None:
            starts = [next((n for n in names if path_matches(glob, n)), None) for glob in p.sp_starts()]
            ends = [next((n for n in reversed(names) if path_matches(glob, n)), None) for glob in p.sp_ends()]
            m.sp_start = tuple(_join(prefix, n) for n in starts if n is not None) or None
            m.sp_end = tuple(_join(prefix, n) for n in ends if n is not None) or None
        if not m.entries:
            warnings.warn(f"lightning_tp: plan {p.name!r} matched no module under {prefix or 'the model'}.")
        _report(p, root, prefix, names)
        matches.append(m)
    if tp > 1 and not any(m.entries for m in matches):
        raise ValueError(
            f"MegaStrategy(tp={tp}): no parallelization plan matches {type(model).__name__}. Modules holding "
            f"Linear/Embedding layers: {_unplanned_types(model)}. Pass plan=lightning_tp.Plan(...) (or a dict) that "
            f"names their layers' styles; built-in plans: {[p.name for p in registered_plans()]}.")
    if tp > 1:
        _check_ties(model, matches)
    if sp and tp > 1:
        for m in matches:
            _check_layerdrop(model.get_submodule(m.prefix) if m.prefix else model, m)
            if m.sp_start is None and m.entries:
                warnings.warn(f"lightning_tp: plan {m.plan.name!r} has no sp_start; {m.prefix or 'the model'} runs "
                              f"without sequence parallelism.")
    return matches


def _check_layerdrop(root: nn.Module, m: Match) -> None:
    """LayerDrop (a Hugging Face config's ``layerdrop``, ``encoder_layerdrop``, ``decoder_layerdrop``:
    M2M100's default is 0.05) skips whole blocks in training, the one where SP begins too: the sequence
    would stay whole and be gathered as if split. Refused under sp, before any collective."""
    config = getattr(root, "config", None)
    drops = {n: getattr(config, n, 0) for n in ("layerdrop", "encoder_layerdrop", "decoder_layerdrop")}
    drops = {n: v for n, v in drops.items() if isinstance(v, (int, float)) and v > 0}
    if m.sp_start is not None and drops:
        raise ValueError(f"sequence parallelism (sp=True): {m.prefix or 'the model'}'s config skips blocks at random "
                         f"in training (LayerDrop: {drops}), the block where SP begins included. Set "
                         f"{', '.join(f'config.{n} = 0' for n in drops)}, or sp=False.")


_KEEPS_WEIGHTS = {"region", "sp_norm", "partial", "replicate", "vocab_ce"}  # styles that shard no parameter


def _check_ties(model: nn.Module, matches: list) -> None:
    """A parameter the plan shards must not also sit, whole, in a module the plan leaves alone (a head
    styled 'lm_head' whose tied embedding has no style): the two would silently train apart."""
    sharded, owners = {}, set()  # id(parameter) -> (path, style) of the module sharding it; those paths
    for m in matches:
        for path, style, _ in m.entries:
            if style not in _KEEPS_WEIGHTS:
                owners.add(path)
                for p in model.get_submodule(path).parameters():
                    sharded.setdefault(id(p), (path, style))
    if "" in owners:  # the plan replaces the whole model (an nn.MultiheadAttention on its own)
        return
    for name, module in model.named_modules():
        parts = name.split(".")
        if any(".".join(parts[:i]) in owners for i in range(1, len(parts) + 1)):  # inside a sharded module
            continue
        for p in module.parameters(recurse=False):
            if id(p) in sharded:
                path, style = sharded[id(p)]
                raise ValueError(f"{name} shares a parameter with {path}, which the plan shards ('{style}'), but has no "
                                 f"style of its own: give it one too (an embedding tied to an 'lm_head' is 'vocab'), "
                                 f"or untie them.")


def _report(plan: Plan, root: nn.Module, prefix: str, names: list) -> None:
    """Warn about globs that matched nothing and Linear layers the plan leaves replicated."""
    moe = [n for n, _, _ in find_moe_blocks(root, expert_styles(plan))]  # run by experts/, not the plan
    inside_moe = lambda n: any(n == b or n.startswith(b + ".") for b in moe)  # noqa: E731
    unmatched = [g for g in plan.styles if not any(path_matches(g, n) for n in names)
                 and not any(path_matches(g.rpartition(".")[0], b) for b in moe)]
    if unmatched:
        warnings.warn(f"lightning_tp: plan {plan.name!r}: {unmatched} matched nothing under "
                      f"{prefix or 'the model'}.")
    owned_by_mha = [n for n in names if plan.style_of(n)[0] == "mha"]  # their out_proj goes with them
    unsharded = [_join(prefix, n) for n, mod in root.named_modules()
                 if (isinstance(mod, nn.Linear) or is_conv1d(mod)) and plan.style_of(n)[0] is None
                 and not any(n.startswith(o + ".") or o == "" for o in owned_by_mha) and not inside_moe(n)]
    if unsharded:
        warnings.warn(f"lightning_tp: plan {plan.name!r}: Linear layers left unsharded (replicated on every tp "
                      f"rank): {unsharded[:8]}{' ...' if len(unsharded) > 8 else ''}.")
    if plan.sp_start is not None:
        norms = [_join(prefix, n) for n, mod in root.named_modules()
                 if type(mod).__name__.endswith(("Norm", "LayerNorm", "RMSNorm")) and plan.style_of(n)[0] is None]
        if norms:
            warnings.warn(f"lightning_tp: plan {plan.name!r}: norms without a style: {norms[:8]}. One that runs on "
                          f"sequence shards under sp=True must be 'sp_norm', or its replicas drift apart.")


def apply(model: nn.Module, matches: list, group, tp: int, rank: int, sp: bool) -> dict:
    """Replace the planned modules in place; returns {path: new module}. A module held under several
    paths (T5's ``shared`` is also each stack's ``embed_tokens``) is replaced under all of them."""
    memo, replaced, aliases = {}, {}, defaultdict(list)
    for name, module in model.named_modules(remove_duplicate=False):
        aliases[id(module)].append(name)
    for m in matches:
        ctx = TPContext(group=group, world=tp, rank=rank, sp=sp and m.sp_start is not None, seq_dim=m.plan.seq_dim)
        has_ce = any(style == "vocab_ce" for _, style, _ in m.entries)
        head, head_elsewhere = None, False
        for path, style, options in m.entries:
            module = _held(model, path)
            if module is None:  # on another pipeline stage
                head_elsewhere = head_elsewhere or style == "lm_head"
                continue
            if style == "vocab_ce" and head_elsewhere:
                continue  # the loss only runs on the stage that holds the head
            local_ctx = dataclasses.replace(ctx, sp=False) if options.get("full_input") and ctx.sp else ctx
            new = _build(module, style, local_ctx, path, memo, has_ce, head, options)
            if style == "lm_head":
                head = new
            if style == "vocab_ce" and head is None:
                raise ValueError(f"plan {m.plan.name!r}: {path} is 'vocab_ce' but no 'lm_head' precedes it.")
            if new is not module:
                for alias in aliases[id(module)] or [path]:
                    _set_submodule(model, alias, new)
                replaced[path] = new
        root = model.get_submodule(m.prefix) if m.prefix else model
        for glob, rules in m.plan.attrs.items():
            for name, module in root.named_modules():
                if path_matches(glob, name) and not isinstance(module, PipelinePlaceholder):
                    set_attrs(module, rules, tp)
        if ctx.sp:
            _install_sp_boundaries(model, m, ctx)
        for held in (_held(model, _join(m.prefix, path)) for path in as_tuple(m.plan.outputs)):
            if held is not None:  # (after the sp_end's hook on the same module: see _whole_outputs)
                held.register_forward_hook(_whole_outputs(ctx))
        head_path, head_options = next(((p, o) for p, style, o in m.entries if style == "lm_head"), (None, {}))
        if has_ce and head is not None and not head_options.get("return_shards"):
            root.register_forward_hook(_whole_logits(head_path[len(m.prefix) + 1:] if m.prefix else head_path))
    return replaced


def _whole_outputs(ctx: TPContext):
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


def _whole_logits(head_path: str):
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
        hook = _region_hook(ctx.enter_region, module, options.get("inputs", ()), whole)
        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module
    if style in ("sp_norm", "partial"):
        if ctx.sp or style == "partial":
            for p in module.parameters():
                mark(p, sp_partial=True)
        return module
    raise AssertionError(style)


def _first_tensor_hook(fn):
    def hook(module, args, kwargs):
        if args:
            return (fn(args[0]),) + tuple(args[1:]), kwargs
        for key, value in kwargs.items():
            if hasattr(value, "dim"):
                return args, {**kwargs, key: fn(value)}
        return None
    return hook


def _region_hook(fn, module, names, named_fn=None):
    """The first tensor argument enters the TP region, and each argument named in ``names``, given by
    keyword or at its place in the forward's signature: one entry for all the layers that read it
    (by ``named_fn``, where those are whole under SP; else by ``fn``)."""
    named_fn = named_fn or fn
    if not names:
        return _first_tensor_hook(fn)
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


def _install_sp_boundaries(model, m: Match, ctx: TPContext) -> None:
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
        start = _held(model, path) if path else model
        if start is not None:
            start.register_forward_pre_hook(_first_tensor_hook(partial(enter, path=path)), with_kwargs=True)
    for path in m.sp_ends():
        end = _held(model, path) if path else model
        if end is not None:
            end.register_forward_hook(partial(leave, path=path))


def _held(model: nn.Module, path: str):
    """The module at ``path``, or None where a pipeline placeholder stands on the way."""
    module = model
    for part in path.split(".") if path else []:
        if isinstance(module, PipelinePlaceholder):
            return None
        module = getattr(module, part, None)
        if module is None:
            return None
    return None if isinstance(module, PipelinePlaceholder) else module


def expert_styles(plan) -> list:
    """(glob, options) of the blocks a user's plan (a Plan or dict) styles 'experts'; none for "auto"."""
    if isinstance(plan, dict):
        plan = Plan.from_dict(plan)
    if not isinstance(plan, Plan):
        return []
    return [(glob, options) for glob, (style, options) in ((g, split_style(v)) for g, v in plan.styles.items())
            if style == "experts"]


def blocks_path(model: nn.Module, plan):
    """The block list a plan names (for pipeline parallelism), if any: a path, or an encoder-decoder's
    two (a tuple)."""
    for prefix, p in _find(model, plan, blocks_only=True):
        if not p.pipeline:
            raise ValueError(f"pipeline parallelism (pp > 1) is not supported for {prefix or 'the model'} (plan "
                             f"{p.name!r}): its blocks are not one chain of stages. Use tp/dp only.")
        if p.blocks:
            return _join(prefix, p.blocks) if isinstance(p.blocks, str) else tuple(_join(prefix, b) for b in p.blocks)
    return None


def core_of(model: nn.Module, plan) -> tuple:
    """What a plan names as the attention core for selective recomputation (``Plan.core``), if any."""
    try:
        found = _find(model, plan, blocks_only=True)
    except ValueError:
        return ()
    for _, p in found:
        if p.core:
            return (p.core,) if isinstance(p.core, str) else tuple(p.core)
    return ()


def _set_submodule(model: nn.Module, path: str, new: nn.Module) -> None:
    parent_path, _, leaf = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    setattr(parent, leaf, new)
