"""Placeholders: what stands in for a module another pipeline stage holds, so the user's forward runs
unchanged on every stage; what cannot stand in is refused at the first step. See docs/design/pipeline-cut.md.
"""

from __future__ import annotations

import copy
import functools
import inspect

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map


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
        self._twin[0]._lightning_tp_name = name
        self.skipped = name

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            twin = self.__dict__.get("_twin")
            if twin is None:
                raise
            value = getattr(twin[0], name)
            stage = self.__dict__.get("stage")
            if isinstance(value, nn.Parameter) and stage is not None and self.__dict__.get("runs_in") == "before" \
                    and stage.run.vstage == stage.last_vstage and stage.run.blocks_begun:
                raise ValueError(f"pipeline: the last stage reads {self.skipped}.{name} after the blocks (a head "
                                 f"computed with the embedding's weight, F.linear(h, emb.weight)?), but that "
                                 f"module is on the first stage. Tie through a module instead "
                                 f"(self.head.weight = self.emb.weight): its copies then live on both stages "
                                 f"with their gradients summed.")
            return value

    def extra_repr(self):
        return f"{self.skipped} (on another stage)"


def meta_twins(module: nn.Module, split) -> list:
    """Every meta twin a split made (placeholders', silenced modules', a rank's interleaved blocks'):
    whatever changes the model's dtype (bf16-true) must change theirs too, or their stand-ins stay fp32."""
    twins = [m._twin[0] for m in module.modules() if isinstance(m, PipelinePlaceholder)]
    return twins + [twin for twin, _ in split.silence.values()] + list(split.twins.values()) + \
        list(split.companion_twins.values())


class SkippedBlock(PipelinePlaceholder):
    """A block another stage holds: passes the hidden states through (see :func:`passthrough`)."""

    side_outputs = False  # an encoder-decoder's (see passthrough)
    index = None  # its place in the block list and, with one block list, the StageMap (..run.stage.install):
    stage = None  # the block before the running stage's first checks its other arguments (see ..run.side_inputs)
    piece = False  # one piece of a block (see .block_lists): the stage stops at the first given hidden states

    def forward(self, *args, **kwargs):
        memo, stage = self.__dict__.setdefault("_memo", {}), self.stage
        run = stage.run if stage is not None else None
        if run is not None and stage.run_ends_at.get(self.index) == run.vstage:  # the next stage's first block
            hidden = hidden_place(args, kwargs, memo.setdefault("hidden", hidden_name(self._twin[0])))
            value = args[hidden] if isinstance(hidden, int) else kwargs[hidden]
            if not self.piece or _shaped_as(value, run.last_block_out):  # not a norm's mod(condition)
                raise run.stop(value)
        if run is not None and stage.side_check is not None and run.vstage > 0 \
                and self.index == stage.ranges[run.vstage - 1][1]:
            hidden = hidden_place(args, kwargs, memo.setdefault("hidden", hidden_name(self._twin[0])))
            stage.side_check.compare(run.vstage, self.index, args, kwargs, hidden)
        out = passthrough(self._twin[0], args, kwargs, self.side_outputs, memo)
        if run is not None:
            run.passed_through = handed_on(out)
        return out


def skipped(block: nn.Module, name: str, piece: bool = False) -> nn.Module:
    """What stands in for a block another stage holds: a :class:`SkippedBlock`, or for a block called
    piece by piece (an ``nn.ModuleList`` / ``nn.ModuleDict``, see .block_lists) the same container of
    skipped pieces, so the user's ``for attn, ff in self.layers`` unpacks it as it does the block."""
    if isinstance(block, nn.ModuleDict):
        return nn.ModuleDict({key: skipped(child, f"{name}.{key}", True) for key, child in block.items()})
    if isinstance(block, nn.ModuleList):
        return nn.ModuleList(skipped(child, f"{name}.{j}", True) for j, child in enumerate(block))
    out = SkippedBlock(block, name)
    out.piece = piece
    return out


def _shaped_as(value, shape) -> bool:
    return isinstance(value, torch.Tensor) and (tuple(value.shape), value.dtype) == shape


def handed_on(out):
    """The hidden states in what a skipped block returned (a tensor, or a tuple's first element)."""
    return out if isinstance(out, torch.Tensor) else out[0]


def passthrough(twin: nn.Module, args, kwargs, side_outputs: bool, memo: dict):
    """What a block outside the running stage returns: its input hidden states, in the structure the
    real block returns (worked out once by its meta ``twin``; ``side_outputs``: the rest as stand-ins).
    See docs/design/pipeline-cut.md."""
    if "hidden" not in memo:
        memo["hidden"] = hidden_name(twin)
    hidden = args[0] if args else kwargs[hidden_place(args, kwargs, memo["hidden"])]
    if side_outputs and not memo.get("plain"):
        try:
            out = stand_in_output(twin, args, kwargs)
        except Exception:  # noqa: BLE001 - a block that cannot run on meta: the plain path below
            out = hidden
        if not isinstance(out, torch.Tensor):
            return type(out)((hidden,) + tuple(out[1:]))
        memo["plain"] = True
    if "structure" not in memo:
        try:
            out = _meta_run(twin, args, kwargs)
        except Exception:  # noqa: BLE001 - a block that cannot run on meta: assume it returns a tensor
            out = hidden
        memo["structure"] = None if isinstance(out, torch.Tensor) else (
            type(out), [isinstance(x, torch.Tensor) for x in out])
    if memo["structure"] is None:
        return hidden
    kind, tensors = memo["structure"]
    name = getattr(twin, "_lightning_tp_name", "a block")
    return kind((hidden,) + tuple(OnAnotherStage(f"output {i} of {name}") if t else None
                                  for i, t in enumerate(tensors[1:], 1)))


class OnAnotherStage:
    """What a skipped block returns besides its hidden states where the real one returns a tensor (an
    MoE auxiliary loss): a None check passes, any computation with it raises. See docs/design/pipeline-cut.md."""

    def __init__(self, what: str):
        self.what = what

    def _fail(self, *args, **kwargs):
        raise ValueError(f"pipeline: the user's code uses {self.what}, which is computed on another pipeline stage; "
                         f"only a block's hidden states travel between stages (an auxiliary loss of each block, "
                         f"as in mixture-of-experts blocks, cannot reach the loss). Use tp/dp for this model.")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        found = []
        tree_map(lambda a: found.append(a) if isinstance(a, cls) else None, (args, kwargs or {}))
        found[0]._fail()  # torch calls this only when an argument (maybe in a list) is one

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = _fail
    __matmul__ = __rmatmul__ = __neg__ = __pow__ = __bool__ = __float__ = __getitem__ = __iter__ = __len__ = _fail

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        self._fail()

    def __repr__(self):
        return f"OnAnotherStage({self.what})"


def positional_names(block: nn.Module) -> list:
    """The names of a block's positional parameters, read from its class (a wrapper on the instance,
    activation checkpointing's or ours, takes ``*args``); [] when there is no signature to read."""
    return list(_positional_names(type(block).forward))


@functools.lru_cache(maxsize=None)
def _positional_names(forward) -> tuple:
    """Per forward function: placeholders ask at every microbatch, and inspect.signature is slow."""
    try:
        params = list(inspect.signature(forward).parameters.values())[1:]  # after self
    except (TypeError, ValueError):
        return ()
    return tuple(p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


def hidden_name(block: nn.Module):
    """The name of a block's first parameter: where its hidden states go when it is called by keyword
    (``block(mask=m, x=h)``), or None."""
    return next(iter(positional_names(block)), None)


def hidden_place(args, kwargs, name=None):
    """Where a block is given its hidden states: the first positional argument, else the keyword of its
    first parameter (``name``, see :func:`hidden_name`), else the first keyword."""
    if args:
        return 0
    return name if name in kwargs else next(iter(kwargs), None)


class ShapeOnly(PipelinePlaceholder):
    """Runs the meta twin of the original to return stand-ins of the true output shape."""

    runs_in = None  # "before" / "after": the stage the original went to (see outer_modules.outer_groups)
    stage = None  # the StageMap, with one block list (see ..run.stage.install): checks where it is called

    def forward(self, *args, **kwargs):
        if self.stage is not None:
            _check_place(self, self.stage)
            if not self.stage.run.blocks_begun:
                self.stage.run.called_before_blocks.add(self.skipped)
        return stand_in_output(self._twin[0], args, kwargs, getattr(self.stage, "device", None))


def _check_place(placeholder: "ShapeOnly", stage) -> None:
    """Raise where a placeholder is called where its original should have run (the module went to the
    wrong end of the pipeline). See docs/design/pipeline-cut.md."""
    run = stage.run
    wrong = {"after": run.vstage == 0, "before": run.vstage == stage.last_vstage and run.blocks_begun}
    if wrong.get(placeholder.runs_in) and run.blocks_begun and placeholder.skipped in run.called_before_blocks:
        raise ValueError(f"pipeline: {placeholder.skipped} ran before the blocks and again after them: the step calls "
                         f"the model's forward more than once (generate(), or a loop over the model), which a pipeline "
                         f"cannot run. Under pp a training, validation, test or predict step (trainer.predict) may "
                         f"call the model once. To generate, load the checkpoint into MegaStrategy(pp=1) with tp/dp "
                         f"(greedy generation under tp equals one process), or into the plain module "
                         f"(lightning_tp.consolidate).")
    if wrong.get(placeholder.runs_in):
        where = ("before the blocks, but went to the last stage (it holds a Linear and no embedding)"
                 if placeholder.runs_in == "after" else
                 "after the blocks, but went to the first stage (it is registered before them and holds no Linear)")
        parent, _, leaf = placeholder.skipped.rpartition(".")
        if leaf.isdigit():  # one of a list of its own called inside the loop (self.norms[i](h))
            holder = "last" if placeholder.runs_in == "after" else "first"
            raise ValueError(f"pipeline: {placeholder.skipped} went to the {holder} stage but is called where this "
                             f"stage runs, so it would compute with stand-ins in its place. A list with one module "
                             f"per block, called inside the loop over the blocks, goes with them when "
                             f"your loop walks both: `for block, x in zip(self.blocks, self.{parent.rpartition('.')[2]})`"
                             f" (module i then runs on block i's stage). Or use tp/dp for this model.")
        raise ValueError(f"pipeline: {placeholder.skipped} runs {where}, so this stage would compute with stand-ins "
                         f"in its place. Its place is read from where the block list's parent module calls it "
                         f"(`self.{leaf}(...)` in its forward), which did not say here. Call it in that forward, or "
                         f"use tp/dp for this model.")


def stand_in_output(twin: nn.Module, args, kwargs, home=None):
    """What a module another stage holds returns here: tensors of the original output's shape and dtype,
    NaN where floating-point (else zeros), on its inputs' device (``home`` where they sit on meta), shapes cached
    per argument signature. See docs/design/pipeline-cut.md."""
    device = next((t.device for t in _tensors(args, kwargs) if not t.is_meta), home or torch.device("cpu"))
    key = _signature(args, {k: v for k, v in kwargs.items() if not is_cache(k, v)})  # T5 passes its cache
    shapes = twin.__dict__.setdefault("_lightning_tp_shapes", {})
    out = shapes.get(key) if key is not None else None
    if out is None:
        out = _meta_run(twin, args, kwargs)
        if key is not None:
            shapes[key] = out
    return tree_map(lambda t: _marked(_filled(t, device)) if isinstance(t, torch.Tensor) else t, out)


def _filled(t: torch.Tensor, device) -> torch.Tensor:
    fill = float("nan") if t.dtype.is_floating_point or t.dtype.is_complex else 0
    return torch.full(t.shape, fill, dtype=t.dtype, device=device)


def holds_nan(result) -> bool:
    flat, _ = tree_flatten(result)
    return any(isinstance(t, torch.Tensor) and t.is_floating_point() and bool(torch.isnan(t.detach()).any())
               for t in flat)


def agree_on_stand_ins(found, device) -> None:
    """At the end of the first training step, on every rank: refuse on all ranks if any stage's result
    held NaN (most likely a placeholder's stand-in carried past its first block). See docs/design/pipeline-cut.md."""
    none = 1 << 62
    flag = torch.tensor([none if found is None else found[0] * 1_000_000 + found[1]], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)  # the first stage it shows on: later ones inherit its NaN
    if flag.item() == none:
        return
    vstage, microbatch = divmod(int(flag.item()), 1_000_000)
    raise ValueError(
        f"pipeline: virtual stage {vstage}'s result for microbatch {microbatch} is NaN at the first step. A module "
        f"another stage holds returns NaN here, so your code most likely uses a value made by one past this "
        f"stage's first block: the embedding's output added after the blocks (head(h + x0)) or between them "
        f"(h = block(h) + x0). Only hidden states travel between stages: pass it to the blocks, or use tp/dp "
        f"for this model. (Or the model gives NaN in one process too: check its data and initialization, and a "
        f"loss over a microbatch whose labels are all ignore_index.)")


def _marked(stand_in: torch.Tensor) -> torch.Tensor:
    """A placeholder's output, marked: the code may hold it elsewhere too (``x0 = emb(x)``), so a stage's
    first block does not write the received activation into it (see ..run.stage._takes_in_place)."""
    stand_in._lightning_tp_placeholder = True
    return stand_in


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


CACHE_KWARGS = ("past_key_value", "past_key_values", "layer_past")  # Hugging Face's key/value caches


def is_cache(name: str, value) -> bool:
    """A key/value cache argument: by its name, or a Hugging Face ``Cache`` object under any name (T5's
    blocks take ``cache=`` in transformers 5.x)."""
    return name in CACHE_KWARGS or (type(value).__name__.endswith("Cache") and callable(getattr(value, "update", None)))


def no_cache(name: str, value):
    """An argument as given to a run that must not touch the key/value cache (a shape run, a
    recomputed forward): a cache object is shared by the model's blocks and would be appended to."""
    if is_cache(name, value):
        return None
    return False if name == "use_cache" and value else value


def _meta_run(twin: nn.Module, args, kwargs):
    """``twin`` called on meta copies of the arguments; a block of experts whose routing cannot run on meta
    (Switch Transformers') answers with its output's shapes instead."""
    from ...experts.blocks.switch import on_meta
    from ...experts.families import SWITCH, find_moe_blocks

    meta_args, meta_kwargs = _meta_call(args, kwargs)
    stubbed = [block for _, block, family in find_moe_blocks(twin) if family is SWITCH]
    for block in stubbed:
        block.forward = functools.partial(on_meta, block)
    try:
        return twin(*meta_args, **meta_kwargs)
    finally:
        for block in stubbed:
            del block.forward


def _meta_call(args, kwargs):
    """The arguments on the meta device, without a key/value cache (T5 passes one while training)."""
    return tree_map(_to_meta, (args, {k: no_cache(k, v) for k, v in kwargs.items()}))


def _to_meta(t):
    return t.to("meta") if isinstance(t, torch.Tensor) else t


def _tensors(args, kwargs):
    return [t for t in list(args) + list(kwargs.values()) if isinstance(t, torch.Tensor)]
