"""Cut a model into pipeline stages without touching its code.

The stage unit is the model's repeated block list (an ``nn.ModuleList`` of same-class blocks).
Contiguous blocks go to each virtual stage; modules with parameters outside the block list go to
the first stage when they hold an embedding (or come before the blocks and hold no Linear, like a
patch embedding), else to the last stage (final norm, head): registration order alone is not
enough, since litgpt registers its LM head before its blocks.
On a rank that does not own a module it is replaced by a placeholder: skipped blocks pass their
input through, other modules return zeros of the right shape (worked out on the meta device), so
the user's forward still runs from top to bottom on every stage. An encoder-decoder's two block
lists form one chain of stages (see :mod:`.encoder_decoder` and ``StageLayout.runs``).
"""

from __future__ import annotations

import copy
import inspect
import re
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
            state = self.__dict__.get("stage")
            if isinstance(value, nn.Parameter) and state is not None and self.__dict__.get("runs_in") == "before" \
                    and state.active == state.last_vstage and state.entered:
                raise ValueError(f"pipeline: the last stage reads {self.skipped}.{name} after the blocks (a head "
                                 f"computed with the embedding's weight, F.linear(h, emb.weight)?), but that "
                                 f"module is on the first stage. Tie through a module instead "
                                 f"(self.head.weight = self.emb.weight): its copies then live on both stages "
                                 f"with their gradients summed.")
            return value

    def extra_repr(self):
        return f"{self.skipped} (on another stage)"


def meta_twins(module: nn.Module, split: dict) -> list:
    """Every meta twin a split made (placeholders', silenced modules', a rank's interleaved blocks'):
    whatever changes the model's dtype (bf16-true) must change theirs too, or their zeros stay fp32."""
    twins = [m._twin[0] for m in module.modules() if isinstance(m, PipelinePlaceholder)]
    return twins + [twin for twin, _ in split["silence"].values()] + list(split["twins"].values())


class SkippedBlock(PipelinePlaceholder):
    """A block another stage holds: passes the hidden states through (see :func:`passthrough`)."""

    side_outputs = False  # an encoder-decoder's (see passthrough)

    def forward(self, *args, **kwargs):
        return passthrough(self._twin[0], args, kwargs, self.side_outputs, self.__dict__.setdefault("_memo", {}))


def passthrough(twin: nn.Module, args, kwargs, side_outputs: bool, memo: dict):
    """What a block outside the running stage returns: its input hidden states, in the structure the
    real block returns (a tensor, or a tuple whose first element is the hidden states, as Hugging
    Face blocks return), worked out once by its meta ``twin``. In an encoder-decoder the rest of a
    tuple is zeros of its shape (``side_outputs``): T5's first block returns the position bias the
    later ones are given, which then travels between stages (None would not say a tensor is expected
    there)."""
    if "hidden" not in memo:
        memo["hidden"] = hidden_name(twin)
    hidden = args[0] if args else kwargs[hidden_place(args, kwargs, memo["hidden"])]
    if side_outputs and not memo.get("plain"):
        try:
            out = zeros_like_output(twin, args, kwargs)
        except Exception:  # noqa: BLE001 - a block that cannot run on meta: the plain path below
            out = hidden
        if not isinstance(out, torch.Tensor):
            return type(out)((hidden,) + tuple(out[1:]))
        memo["plain"] = True
    if "structure" not in memo:
        try:
            meta_args, meta_kwargs = _meta_call(args, kwargs)
            out = twin(*meta_args, **meta_kwargs)
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
    """What a block outside the running stage returns besides its hidden states, where the real block
    returns a tensor (an MoE block's auxiliary loss): only hidden states travel between stages, so it
    is not here. Checks for None pass; any use of it in a computation says so instead of failing on
    ``None`` (``loss + aux``) or going on with zeros."""

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
    try:
        params = list(inspect.signature(type(block).forward).parameters.values())[1:]  # after self
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


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
    """Runs the meta twin of the original to return zeros of the true output shape."""

    runs_in = None  # "before" / "after": the stage the original went to (see _outer_groups)
    stage = None  # the StageState, with one block list (see stage.install): checks where it is called

    def forward(self, *args, **kwargs):
        if self.stage is not None:
            _check_place(self, self.stage)
        return zeros_like_output(self._twin[0], args, kwargs)


def _check_place(placeholder: "ShapeOnly", state) -> None:
    """A placeholder called where its original should have run: the module went to the wrong end of
    the pipeline (where the code calls it could not be read, see _called_around), and the run would
    go on with zeros in its place. A module of the last stage called in the first stage's run runs
    before the blocks; one of the first stage called after the last stage's blocks began runs after."""
    wrong = {"after": state.active == 0, "before": state.active == state.last_vstage and state.entered}
    if wrong.get(placeholder.runs_in):
        where = ("before the blocks, but went to the last stage (it holds a Linear and no embedding)"
                 if placeholder.runs_in == "after" else
                 "after the blocks, but went to the first stage (it is registered before them and holds no Linear)")
        raise ValueError(f"pipeline: {placeholder.skipped} runs {where}, so this stage would compute with zeros "
                         f"in its place. Its place is read from where the block list's parent module calls it "
                         f"(`self.{placeholder.skipped.rpartition('.')[2]}(...)` in its forward), which did not "
                         f"say here. Call it in that forward, or use tp/dp for this model.")


def zeros_like_output(twin: nn.Module, args, kwargs):
    """Zeros shaped like what the original module returns for these arguments. The meta run that
    finds the shapes costs ~0.1 ms a call, once per microbatch on every later stage: its result is
    kept per argument signature (shapes and dtypes, plain values) where the arguments have one."""
    device = next((t.device for t in _tensors(args, kwargs)), torch.device("cpu"))
    key = _signature(args, {k: v for k, v in kwargs.items() if k not in CACHE_KWARGS})  # T5 passes its cache
    shapes = twin.__dict__.setdefault("_lightning_tp_shapes", {})
    out = shapes.get(key) if key is not None else None
    if out is None:
        meta_args, meta_kwargs = _meta_call(args, kwargs)
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


CACHE_KWARGS = ("past_key_value", "past_key_values", "layer_past")  # Hugging Face's key/value caches


def _meta_call(args, kwargs):
    """The arguments on the meta device, without a key/value cache: a cache object is shared by the
    model's blocks, and a shape run must not append meta keys to it (T5 passes one while training)."""
    kwargs = {k: (None if k in CACHE_KWARGS else False if k == "use_cache" else v) for k, v in kwargs.items()}
    return tree_map(_to_meta, (args, kwargs))


def _to_meta(t):
    return t.to("meta") if isinstance(t, torch.Tensor) else t


def _tensors(args, kwargs):
    return [t for t in list(args) + list(kwargs.values()) if isinstance(t, torch.Tensor)]


# ------------------------------------------------------------------------------ finding the blocks


def is_block_list(module: nn.Module) -> bool:
    """An ``nn.ModuleList`` of two or more modules of one class: a model's repeated blocks."""
    return isinstance(module, nn.ModuleList) and len(module) >= 2 and len({type(b) for b in module}) == 1


def find_blocks(model: nn.Module, name: str | None = None) -> tuple[str, nn.ModuleList]:
    if isinstance(name, (list, tuple)) and len(name) == 1:
        name = name[0]
    if name is not None:
        try:
            blocks = model.get_submodule(name)
        except AttributeError:
            raise ValueError(f"pipeline_blocks={name!r}: no such module in {type(model).__name__}.") from None
        if not isinstance(blocks, nn.ModuleList):
            raise ValueError(f"pipeline_blocks={name!r} is a {type(blocks).__name__}, not an nn.ModuleList.")
        return name, blocks
    best, found = None, []
    for path, module in model.named_modules():
        if any(path.startswith(p + ".") for p in found):
            continue  # a list inside a block (an MoE block's experts, heads): never the pipeline's
        if is_block_list(module):
            found.append(path)
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
    """Which blocks each virtual stage runs. Virtual stage k = chunk * pp + pp_rank.

    An encoder-decoder's two block lists form one chain (``lists``): block i of the chain is encoder
    block i below the encoder's length, else decoder block i - length (see :mod:`.stage`)."""

    blocks_path: str  # an encoder-decoder's: its two paths joined by " + "
    ranges: list  # per virtual stage: (first block index, last block index)
    pp: int
    v: int
    lists: tuple = ()  # an encoder-decoder: ((encoder path, length), (decoder path, length))
    tied_head: bool = False  # an encoder-decoder whose head shares the embedding's weight

    @property
    def last_vstage(self) -> int:
        return self.pp * self.v - 1

    @property
    def decoder_start(self):
        """The chain index of the decoder's first block, or None (one block list)."""
        return self.lists[0][1] if self.lists else None

    def vstages_of(self, pp_rank: int) -> list:
        return [c * self.pp + pp_rank for c in range(self.v)]

    def vstage_of(self, block: int) -> int:
        return next(k for k, (lo, hi) in enumerate(self.ranges) if lo <= block <= hi)

    def locate(self, block: int) -> tuple[str, int]:
        """(list path, index in that list) of a chain index."""
        if not self.lists:
            return self.blocks_path, block
        (encoder, n), (decoder, _) = self.lists
        return (encoder, block) if block < n else (decoder, block - n)

    def blocks(self, model: nn.Module) -> "ChainedBlocks":
        return ChainedBlocks(model, self)

    def runs(self) -> dict:
        """Virtual stages that run each kind of module outside the blocks: the first stage's (embeddings),
        the last's (head), and an encoder-decoder's modules between its lists: the encoder's (its final
        norm, a bridge) on the stage holding the encoder's last block, the decoder's (BART's embedding
        norm) on the one holding its first. An encoder-decoder's decoder takes its own input from the
        embeddings, so the stage holding the decoder's first block holds them too (Megatron's T5 does
        the same): their gradients are summed over both copies, as tied weights are."""
        runs = {"before": {0}, "between": set(), "decoder_in": set(), "after": {self.last_vstage}}
        if self.lists:
            runs["before"].add(self.vstage_of(self.decoder_start))
            runs["between"].add(self.vstage_of(self.decoder_start - 1))
            runs["decoder_in"].add(self.vstage_of(self.decoder_start))
        return runs

    def replica_ranks(self) -> tuple:
        """pp ranks holding a copy of the first stage's modules (an encoder-decoder's decoder stage; with a
        tied head the last stage too, where they do not run: every copy sums the same tensors)."""
        ranks = {k % self.pp for k in self.runs()["before"]} | ({self.pp - 1} if self.tied_head else set())
        return tuple(sorted(ranks))


class ChainedBlocks:
    """Blocks by chain index, read and replaced in their own lists (so state-dict keys stay)."""

    def __init__(self, model: nn.Module, layout: StageLayout):
        self.model, self.layout = model, layout

    def __len__(self) -> int:
        return self.layout.ranges[-1][1] + 1

    def __getitem__(self, i: int) -> nn.Module:
        path, j = self.layout.locate(i)
        return self.model.get_submodule(path)[j]

    def __setitem__(self, i: int, module: nn.Module) -> None:
        path, j = self.layout.locate(i)
        self.model.get_submodule(path)[j] = module

    def name(self, i: int) -> str:
        path, j = self.layout.locate(i)
        return f"{path}.{j}"


def plan_stages(model: nn.Module, pp: int, v: int = 1, blocks=None, stage_layers=None,
                interleaved: bool = False) -> StageLayout:
    """Validate and assign; raises ValueError (same on every rank) before anything changes. ``blocks``:
    a block list's path, or an encoder-decoder's two (a list: encoder, then decoder)."""
    from .encoder_decoder import encoder_decoder, find_encoder_decoder  # it uses this module's search

    lists, tied_head = (), False
    pair = find_encoder_decoder(model)
    if blocks is None or (pair and blocks == pair[0]):
        blocks = pair or blocks  # naming the encoder's list (nn.TransformerEncoder's plan does) takes the pair
    if isinstance(blocks, (list, tuple)) and len(blocks) != 1:
        lists, tied_head = encoder_decoder(model, blocks, pp)
        path = " + ".join(p for p, _ in lists)
        module = [b for p, _ in lists for b in model.get_submodule(p)]
    else:
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
    return StageLayout(path, ranges, pp, v, lists, tied_head)


def apply_split(model: nn.Module, layout: StageLayout, pp_rank: int) -> dict:
    """Replace what this rank does not own with placeholders. Returns {"tied": [shared Parameters],
    "silence": {module path: (meta twin, virtual stages it runs in)}: modules this rank holds that
    another of its chunks would rerun (and their collectives) for nothing, "twins": {block index:
    meta twin} of its blocks under the interleaved schedule (see stage._passthrough_of)}."""
    blocks = layout.blocks(model)
    mine = set()
    for k in layout.vstages_of(pp_rank):
        lo, hi = layout.ranges[k]
        mine.update(range(lo, hi + 1))
    groups = _outer_groups(model, [p for p, _ in layout.lists] or [layout.blocks_path])
    params_before = {id(p) for _, m in groups["before"] for p in m.parameters()}
    if layout.lists:  # the decoder's copy of the embeddings (see StageLayout.runs)
        tied = [p for _, m in groups["before"] for p in m.parameters()] if len(layout.replica_ranks()) > 1 else []
    else:
        tied = [p for _, m in groups["after"] for p in m.parameters() if id(p) in params_before]
    # interleaved: this rank's blocks also run outside their stage (in its other chunks' runs), passing
    # their input through; the structure they return is worked out by a meta twin made before sharding
    twins = {i: meta_twin(blocks[i]) for i in sorted(mine)} if layout.v > 1 else {}
    for i in range(len(blocks)):
        if i not in mine:
            blocks[i] = SkippedBlock(blocks[i], blocks.name(i))
            blocks[i].side_outputs = bool(layout.lists)
    silence, my_vstages = {}, set(layout.vstages_of(pp_rank))
    for kind, runs in layout.runs().items():
        owned = bool(runs & my_vstages) or (kind == "before" and pp_rank in layout.replica_ranks())
        for name, m in groups[kind]:
            if not owned:
                _set(model, name, ShapeOnly(m, name))
                model.get_submodule(name).runs_in = kind
                continue
            if kind != "after" and my_vstages - runs:
                silence[name] = (meta_twin(m), runs)
            # run by two of its chunks, held without running, or an encoder-decoder's copy (parts of which
            # its stage may not use): no one backward pass finalizes the gradient (see dp_overlap)
            if len(runs & my_vstages) != 1 or (kind == "before" and len(layout.replica_ranks()) > 1):
                for p in m.parameters():
                    p._pp_late_sync = True
    order = {id(p): i for i, p in enumerate(p for _, m in groups["before"] for p in m.parameters())}
    for p in tied:  # numbered as in the unsplit model: every copy sums in one order (see grads._sum_tied)
        p._pp_tied, p._pp_tied_index, p._pp_copy = True, order[id(p)], bool(layout.lists)
    holds_tied = pp_rank in (layout.replica_ranks() if layout.lists else (0, layout.pp - 1))
    return {"tied": tied if holds_tied else [], "silence": silence, "twins": twins}


def _outer_groups(model: nn.Module, paths: list) -> dict:
    """Top-most modules with parameters outside the block lists, by where they run: "before" (the
    first stage: embeddings, or anything before the blocks without a Linear), "after" (the rest), and
    for an encoder-decoder (see :func:`_encoder_decoder_kind`) "between" and "decoder_in"."""
    groups, seen, taken = {"before": [], "between": [], "decoder_in": [], "after": []}, 0, []
    called = _called_around(model, paths[0]) if len(paths) == 1 else {}
    for name, m in model.named_modules():
        if name in paths:
            seen += 1
            taken.append(name)
            continue
        if not name or any(name.startswith(t + ".") for t in taken) or any(p.startswith(name + ".") for p in paths):
            continue
        if any(True for _ in m.parameters(recurse=False)) or _is_leafy_owner(m):
            kind = "before" if _runs_first(m, seen > 0, called.get(name)) else "after"
            if kind == "after" and len(paths) == 2:
                kind = _encoder_decoder_kind(name, paths, seen)
            groups[kind].append((name, m))
            taken.append(name)
    return groups


def _encoder_decoder_kind(name: str, paths: list, seen: int) -> str:
    """Where a non-embedding module of an encoder-decoder runs. Registration order is not running order
    here (BART registers its input norms after its layers), so the parent module decides: inside the
    encoder's, an input norm ("embed" in its name) runs first and the rest (the final norm) where the
    encoder ends ("between"); inside the decoder's, an input norm, or anything registered before its
    blocks, runs where the decoder starts ("decoder_in"), the rest last; elsewhere, registration order
    (a bridge between the lists runs where the encoder ends)."""
    encoder, decoder = (p.rpartition(".")[0] + "." for p in paths)
    input_norm = "embed" in name.rpartition(".")[2]
    if encoder.startswith(decoder) or decoder.startswith(encoder):  # one parent (or the root): no rule by it
        return "between" if seen == 1 else "after"
    if name.startswith(encoder):
        return "before" if input_norm else "between"
    if name.startswith(decoder):
        return "decoder_in" if input_norm or seen == 1 else "after"
    return "between" if seen == 1 else "after"


def holds_linear(m: nn.Module) -> bool:
    """Whether ``m`` holds a Linear (Hugging Face's Conv1D, GPT-2's, counts as one)."""
    return any(isinstance(c, nn.Linear) or type(c).__name__ == "Conv1D" for c in m.modules())


def _runs_first(m: nn.Module, after_blocks: bool, called=None) -> bool:
    """Embeddings run first; else where the code calls it (``called``: "before" or "after" the blocks,
    see :func:`_called_around`), else by registration: before the blocks without a Linear."""
    if any(isinstance(c, nn.Embedding) for c in m.modules()):
        return True
    if called is not None:
        return called == "before"
    return not after_blocks and not holds_linear(m)


def _called_around(model: nn.Module, blocks_path: str) -> dict:
    """Path -> "before" or "after": where the forward of the block list's parent calls each of its other
    children (``self.norm(...)``) relative to its loop over the blocks, read from the source. OPT
    registers its final norm and its input and output projections before its layers; registration
    order would put the norm first and the input projection last."""
    parent_path, _, leaf = blocks_path.rpartition(".")
    parent = model.get_submodule(parent_path)
    for method in ("forward", "training_step"):  # a LightningModule may loop over its blocks in its step
        try:
            source = inspect.getsource(getattr(type(parent), method))
        except (AttributeError, OSError, TypeError):
            continue
        loop = re.search(rf"\bin\s+(?:enumerate\()?self\.{re.escape(leaf)}\b|self\.{re.escape(leaf)}\[", source)
        if loop is not None:
            break
    else:
        return {}
    out = {}
    for child, _ in parent.named_children():
        call = re.search(rf"\bself\.{re.escape(child)}\s*\(", source)
        if child != leaf and call is not None:
            out[f"{parent_path}.{child}" if parent_path else child] = "before" if call.start() < loop.start() else "after"
    return out


def _is_leafy_owner(m: nn.Module) -> bool:
    """A module whose parameters all sit in children that are not containers of other blocks."""
    return any(True for _ in m.parameters()) and not any(isinstance(c, nn.ModuleList) for c in m.modules())


def _set(model: nn.Module, path: str, new: nn.Module) -> None:
    parent, _, leaf = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)
