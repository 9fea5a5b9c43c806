"""Cut a model into pipeline stages without touching its code.

The stage unit is the model's repeated block list (an ``nn.ModuleList`` of same-class blocks).
Contiguous blocks go to each virtual stage; modules with parameters outside the block list go to
the first stage when they hold an embedding (or come before the blocks and hold no Linear, like a
patch embedding), else to the last stage (final norm, head): registration order alone is not
enough, since litgpt registers its LM head before its blocks.
On a rank that does not own a module it is replaced by a placeholder: skipped blocks pass their
input through, other modules return zeros of the right shape (worked out on the meta device), so
the user's forward still runs from top to bottom on every stage.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._pytree import tree_map


def meta_twin(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose parameters and buffers live on the meta device (no memory)."""
    memo = {id(t): torch.empty_like(t, device="meta") for t in list(module.parameters()) + list(module.buffers())}
    memo.update({id(p): nn.Parameter(memo[id(p)], requires_grad=False) for p in module.parameters()})
    return copy.deepcopy(module, memo)


class PipelinePlaceholder(nn.Module):
    """Stands in for a module another stage holds: no parameters, no buffers. Attribute reads the
    user's code makes (``layers[0].self_attn.batch_first``) are answered by a meta twin."""

    def __init__(self, module: nn.Module, name: str):
        super().__init__()
        self._twin = [meta_twin(module)]  # a list: not a registered submodule
        self.skipped = name

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            twin = self.__dict__.get("_twin")
            if twin is None:
                raise
            return getattr(twin[0], name)

    def extra_repr(self):
        return f"{self.skipped} (on another stage)"


class SkippedBlock(PipelinePlaceholder):
    """Passes the hidden states through, in the structure the real block returns (a tensor, or a
    tuple whose first element is the hidden states, as Hugging Face blocks return)."""

    def forward(self, *args, **kwargs):
        hidden = args[0] if args else next(iter(kwargs.values()))
        if not hasattr(self, "_structure"):
            try:
                meta_args, meta_kwargs = tree_map(_to_meta, (args, kwargs))
                out = self._twin[0](*meta_args, **meta_kwargs)
            except Exception:  # noqa: BLE001 - a block that cannot run on meta: assume it returns a tensor
                out = hidden
            self._structure = None if isinstance(out, torch.Tensor) else (type(out), len(out))
        if self._structure is None:
            return hidden
        kind, n = self._structure
        return kind((hidden,) + (None,) * (n - 1))


class ShapeOnly(PipelinePlaceholder):
    """Runs the meta twin of the original to return zeros of the true output shape."""

    def forward(self, *args, **kwargs):
        return zeros_like_output(self._twin[0], args, kwargs)


def zeros_like_output(twin: nn.Module, args, kwargs):
    """Zeros shaped like what the original module returns for these arguments. The meta run that
    finds the shapes costs ~0.1 ms a call, once per microbatch on every later stage: its result is
    kept per argument signature (shapes and dtypes, plain values) where the arguments have one."""
    device = next((t.device for t in _tensors(args, kwargs)), torch.device("cpu"))
    key = _signature(args, kwargs)
    shapes = twin.__dict__.setdefault("_lightning_tp_shapes", {})
    out = shapes.get(key) if key is not None else None
    if out is None:
        meta_args, meta_kwargs = tree_map(_to_meta, (args, kwargs))
        out = twin(*meta_args, **meta_kwargs)
        if key is not None:
            shapes[key] = out
    return tree_map(lambda t: torch.zeros(t.shape, dtype=t.dtype, device=device)
                    if isinstance(t, torch.Tensor) else t, out)


def _signature(args, kwargs):
    """A hashable key of the arguments' shapes, dtypes and plain values, or None (a container, an
    object of another kind: the meta run then happens every time)."""
    parts = []
    for name, v in [(None, a) for a in args] + [(k, kwargs[k]) for k in sorted(kwargs)]:
        if isinstance(v, torch.Tensor):
            parts.append((name, tuple(v.shape), v.dtype))
        elif v is None or isinstance(v, (bool, int, float, str)):
            parts.append((name, v))
        else:
            return None
    return tuple(parts)


def _to_meta(t):
    return t.to("meta") if isinstance(t, torch.Tensor) else t


def _tensors(args, kwargs):
    return [t for t in list(args) + list(kwargs.values()) if isinstance(t, torch.Tensor)]


# ------------------------------------------------------------------------------ finding the blocks


def is_block_list(module: nn.Module) -> bool:
    """An ``nn.ModuleList`` of two or more modules of one class: a model's repeated blocks."""
    return isinstance(module, nn.ModuleList) and len(module) >= 2 and len({type(b) for b in module}) == 1


def find_blocks(model: nn.Module, name: str | None = None) -> tuple[str, nn.ModuleList]:
    if name is not None:
        try:
            blocks = model.get_submodule(name)
        except AttributeError:
            raise ValueError(f"pipeline_blocks={name!r}: no such module in {type(model).__name__}.") from None
        if not isinstance(blocks, nn.ModuleList):
            raise ValueError(f"pipeline_blocks={name!r} is a {type(blocks).__name__}, not an nn.ModuleList.")
        return name, blocks
    best = None
    for path, module in model.named_modules():
        if is_block_list(module):
            if best is None or len(module) > len(best[1]):
                best = (path, module)
    if best is None:
        raise ValueError(
            f"pipeline parallelism needs the model's repeated block list (an nn.ModuleList of same-class blocks), "
            f"and none was found in {type(model).__name__}. Name it: MegaStrategy(pp=..., "
            f"pipeline_blocks='path.to.blocks').")
    return best


# ------------------------------------------------------------------------------ assigning stages


def balanced_split(weights: list, parts: int) -> list:
    """Contiguous split of ``weights`` into ``parts`` groups minimizing the heaviest group; returns sizes."""
    n = len(weights)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    sizes, i = [], n
    for k in range(parts, 0, -1):
        sizes.append(i - cut[k][i])
        i = cut[k][i]
    return sizes[::-1]


@dataclass
class StageLayout:
    """Which blocks each virtual stage runs. Virtual stage k = chunk * pp + pp_rank."""

    blocks_path: str
    ranges: list  # per virtual stage: (first block index, last block index)
    pp: int
    v: int

    @property
    def last_vstage(self) -> int:
        return self.pp * self.v - 1

    def vstages_of(self, pp_rank: int) -> list:
        return [c * self.pp + pp_rank for c in range(self.v)]


def plan_stages(model: nn.Module, pp: int, v: int = 1, blocks: str | None = None, stage_layers=None,
                interleaved: bool = False) -> StageLayout:
    """Validate and assign; raises ValueError (same on every rank) before anything changes."""
    path, module = find_blocks(model, blocks)
    n, parts = len(module), pp * v
    if stage_layers is not None:
        stage_layers = list(stage_layers)
        if len(stage_layers) != parts or sum(stage_layers) != n or min(stage_layers) < 1:
            raise ValueError(f"stage_layers={stage_layers} must give {parts} positive counts (pp*virtual_stages) "
                             f"summing to the {n} blocks of {path}.")
        sizes = stage_layers
    else:
        if parts > n:
            raise ValueError(f"pp={pp} x virtual_stages={v} = {parts} stages, but {path} has only {n} blocks; "
                             f"use pp*virtual_stages <= {n}.")
        if interleaved and n % parts:
            raise ValueError(f"the interleaved schedule needs the {n} blocks of {path} divisible by "
                             f"pp*virtual_stages = {parts}; change virtual_stages or set stage_layers.")
        sizes = balanced_split([sum(p.numel() for p in b.parameters()) or 1 for b in module], parts)
    ranges, start = [], 0
    for size in sizes:
        ranges.append((start, start + size - 1))
        start += size
    return StageLayout(path, ranges, pp, v)


def apply_split(model: nn.Module, layout: StageLayout, pp_rank: int) -> dict:
    """Replace what this rank does not own with placeholders. Returns {"tied": [shared Parameters]}."""
    blocks = model.get_submodule(layout.blocks_path)
    mine = set()
    for k in layout.vstages_of(pp_rank):
        lo, hi = layout.ranges[k]
        mine.update(range(lo, hi + 1))
    first, last = pp_rank == 0, pp_rank == layout.pp - 1
    before, after = _outer_modules(model, layout.blocks_path)
    params_before = {id(p) for _, m in before for p in m.parameters()}
    tied = [p for _, m in after for p in m.parameters() if id(p) in params_before]
    for i in range(len(blocks)):
        if i not in mine:
            blocks[i] = SkippedBlock(blocks[i], f"{layout.blocks_path}.{i}")
    for owned, group in ((first, before), (last, after)):
        if not owned:
            for name, m in group:
                _set(model, name, ShapeOnly(m, name))
    for p in tied:
        p._pp_tied = True
    # chunks after the first would rerun these (and their collectives) for nothing: keep shape twins
    twins = {name: meta_twin(m) for name, m in before} if first and layout.v > 1 else {}
    return {"tied": tied if (first or last) else [], "before": twins}


def _outer_modules(model: nn.Module, blocks_path: str):
    """Top-most modules with parameters outside the block list, split by registration order."""
    before, after, seen_blocks, taken = [], [], False, []
    for name, m in model.named_modules():
        if name == blocks_path:
            seen_blocks = True
            taken.append(name)
            continue
        if not name or any(name.startswith(t + ".") for t in taken) or blocks_path.startswith(name + "."):
            continue
        if any(True for _ in m.parameters(recurse=False)) or _is_leafy_owner(m):
            (before if _runs_first(m, seen_blocks) else after).append((name, m))
            taken.append(name)
    return before, after


def _runs_first(m: nn.Module, after_blocks: bool) -> bool:
    kinds = [type(c) for c in m.modules()]
    if any(issubclass(k, nn.Embedding) for k in kinds):
        return True
    return not after_blocks and not any(issubclass(k, nn.Linear) or k.__name__ == "Conv1D" for k in kinds)


def _is_leafy_owner(m: nn.Module) -> bool:
    """A module whose parameters all sit in children that are not containers of other blocks."""
    return any(True for _ in m.parameters()) and not any(isinstance(c, nn.ModuleList) for c in m.modules())


def _set(model: nn.Module, path: str, new: nn.Module) -> None:
    parent, _, leaf = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)
