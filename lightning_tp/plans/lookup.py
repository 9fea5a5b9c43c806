"""Which plan covers which part of a model: the plans found (registered or given), the block lists
and attention cores they name, and the module at a path. See docs/design/plans.md."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from ..pipeline.cut.placeholders import PipelinePlaceholder
from .base import Plan, as_tuple, split_style
from .registry import registered_plans


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


def join(prefix: str, path: str) -> str:
    return f"{prefix}.{path}" if prefix and path else prefix or path


def find(model: nn.Module, plan, blocks_only: bool = False) -> list:
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


def module_at(model: nn.Module, path: str):
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
    for prefix, p in find(model, plan, blocks_only=True):
        if not p.pipeline:
            raise ValueError(f"pipeline parallelism (pp > 1) is not supported for {prefix or 'the model'} (plan "
                             f"{p.name!r}): its blocks are not one chain of stages. Use tp/dp only.")
        if p.blocks:
            return join(prefix, p.blocks) if isinstance(p.blocks, str) else tuple(join(prefix, b) for b in p.blocks)
    return None


def core_of(model: nn.Module, plan) -> tuple:
    """What a plan names as the attention core for selective recomputation (``Plan.core``), if any."""
    try:
        found = find(model, plan, blocks_only=True)
    except ValueError:
        return ()
    for _, p in found:
        if p.core:
            return (p.core,) if isinstance(p.core, str) else tuple(p.core)
    return ()
