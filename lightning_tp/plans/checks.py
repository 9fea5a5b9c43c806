"""A model's plans matched and checked against tp (sizes, styles, ties, LayerDrop) with no communication,
and warnings for what a plan leaves out. See docs/design/plans.md."""

from __future__ import annotations

import inspect
import warnings

from torch import nn

from ..experts.families import find_moe_blocks
from ..layers.linear import is_conv1d
from .base import Plan, path_matches
from .lookup import Match, expert_styles, find, join
from .registry import registered_plans
from .sizes import check_attr, check_sizes, getattr_path


_EXPECTED = {
    "colwise": nn.Linear, "colwise_local": nn.Linear, "rowwise": nn.Linear, "lm_head": nn.Linear,
    "vocab": nn.Embedding, "embedding_cols": nn.Embedding, "vocab_ce": nn.CrossEntropyLoss,
    "mha": nn.MultiheadAttention,
}


def _unplanned_types(model: nn.Module) -> list:
    holders = set()
    for _, module in model.named_modules():
        if any(isinstance(c, (nn.Linear, nn.Embedding, nn.MultiheadAttention)) for c in module.children()):
            holders.add(type(module).__name__)
    return sorted(holders)


def resolve(model: nn.Module, tp: int, sp: bool, plan="auto") -> list:
    """Match plans and check every size against tp. Raises ValueError with module names and numbers."""
    matches = []
    for prefix, p in find(model, plan):
        root = model.get_submodule(prefix) if prefix else model
        m = Match(prefix, p)
        for name, module in root.named_modules():
            style, options = p.style_of(name)
            if style is None or style in ("replicate", "experts"):  # experts: run by experts/, not tp
                continue
            full = join(prefix, name)
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
            if style == "vocab_ce" and not any(s == "lm_head" for _, s, _ in m.entries):
                raise ValueError(f"plan {p.name!r}: {full} is 'vocab_ce' but no 'lm_head' precedes it.")
            m.entries.append((full, style, options))
        for glob, rules in p.attrs.items():
            for name, module in root.named_modules():
                if path_matches(glob, name):
                    for attr, rule in rules.items():
                        check_attr(join(prefix, name), attr, getattr_path(module, attr), rule, tp)
        names = [n for n, _ in root.named_modules()]
        if p.sp_start is not None:
            starts = [next((n for n in names if path_matches(glob, n)), None) for glob in p.sp_starts()]
            ends = [next((n for n in reversed(names) if path_matches(glob, n)), None) for glob in p.sp_ends()]
            m.sp_start = tuple(join(prefix, n) for n in starts if n is not None) or None
            m.sp_end = tuple(join(prefix, n) for n in ends if n is not None) or None
        if not m.entries:
            warnings.warn(f"lightning_tp: plan {p.name!r} matched no module under {prefix or 'the model'}.")
        report(p, root, prefix, names)
        matches.append(m)
    if tp > 1 and not any(m.entries for m in matches):
        raise ValueError(
            f"MegaStrategy(tp={tp}): no parallelization plan matches {type(model).__name__}. Modules holding "
            f"Linear/Embedding layers: {_unplanned_types(model)}. Pass plan=lightning_tp.Plan(...) (or a dict) that "
            f"names their layers' styles; built-in plans: {[p.name for p in registered_plans()]}.")
    if tp > 1:
        check_ties(model, matches)
    if sp and tp > 1:
        for m in matches:
            check_layerdrop(model.get_submodule(m.prefix) if m.prefix else model, m)
            check_sequence_mixers(model.get_submodule(m.prefix) if m.prefix else model, m, tp)
            if m.sp_start is None and m.entries:
                warnings.warn(f"lightning_tp: plan {m.plan.name!r} has no sp_start; {m.prefix or 'the model'} runs "
                              f"without sequence parallelism.")
    return matches


MIXERS = ("Attention", "MLA", "Mamba", "ShortConv", "GatedDeltaNet")  # in a class name: mixes tokens along the sequence


def check_sequence_mixers(root: nn.Module, m: Match, tp: int) -> None:
    """Under sp a block's modules see a sequence shard: refuse one that mixes tokens along the sequence (attention,
    a convolution over it, a state-space layer) unless the plan covers it (a region, or split layers inside)."""
    starts, covered = m.plan.sp_starts(), [full for full, _, _ in m.entries]
    for name, module in root.named_modules():
        parts = name.split(".")
        if not any(path_matches(g, ".".join(parts[:i])) for g in starts for i in range(1, len(parts))):
            continue  # outside the sequence-parallel span
        if not (any(isinstance(c, nn.Conv1d) for c in module.children()) or
                any(k in type(module).__name__ for k in MIXERS)):
            continue
        full = join(m.prefix, name)
        if any(full == c or full.startswith(c + ".") or c.startswith(full + ".") for c in covered):
            continue  # inside a region, or its projections split (a colwise layer gathers the sequence)
        raise ValueError(f"MegaStrategy(tp={tp}, sp=True): {full} ({type(module).__name__}) mixes tokens along the "
                         f"sequence and no plan entry splits it, so under sp it would see one rank's sequence shard. "
                         f"Use sp=False (tp keeps it whole on every rank), or a plan that makes it a 'region'.")


def check_layerdrop(root: nn.Module, m: Match) -> None:
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


def check_ties(model: nn.Module, matches: list) -> None:
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


def report(plan: Plan, root: nn.Module, prefix: str, names: list) -> None:
    """Warn about globs that matched nothing and Linear layers the plan leaves replicated."""
    moe = [n for n, _, _ in find_moe_blocks(root, expert_styles(plan))]  # run by experts/, not the plan
    inside_moe = lambda n: any(n == b or n.startswith(b + ".") for b in moe)  # noqa: E731
    unmatched = [g for g in plan.styles if not any(path_matches(g, n) for n in names)
                 and not any(path_matches(g.rpartition(".")[0], b) for b in moe)]
    if unmatched:
        warnings.warn(f"lightning_tp: plan {plan.name!r}: {unmatched} matched nothing under "
                      f"{prefix or 'the model'}.")
    owned_by_mha = [n for n in names if plan.style_of(n)[0] == "mha"]  # their out_proj goes with them
    unsharded = [join(prefix, n) for n, mod in root.named_modules()
                 if (isinstance(mod, nn.Linear) or is_conv1d(mod)) and plan.style_of(n)[0] is None
                 and not any(n.startswith(o + ".") or o == "" for o in owned_by_mha) and not inside_moe(n)]
    if unsharded:
        warnings.warn(f"lightning_tp: plan {plan.name!r}: Linear layers left unsharded (replicated on every tp "
                      f"rank): {unsharded[:8]}{' ...' if len(unsharded) > 8 else ''}.")
    if plan.sp_start is not None:
        norms = [join(prefix, n) for n, mod in root.named_modules()
                 if type(mod).__name__.endswith(("Norm", "LayerNorm", "RMSNorm")) and plan.style_of(n)[0] is None]
        if norms:
            warnings.warn(f"lightning_tp: plan {plan.name!r}: norms without a style: {norms[:8]}. One that runs on "
                          f"sequence shards under sp=True must be 'sp_norm', or its replicas drift apart.")
