"""Cut a model into pipeline stages without touching its code: contiguous blocks per virtual stage,
the modules around them to the first or last, placeholders for what a rank does not hold.
See docs/design/pipeline-cut.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from .block_lists import block_at, block_key, blocks_of, find_blocks, set_block, zipped_with
from .encoder_decoder import encoder_decoder, find_encoder_decoder
from .outer_modules import outer_groups
from .placeholders import ShapeOnly, SkippedBlock, meta_twin, skipped
from ...marks import set_marks


# ------------------------------------------------------------------------------ finding the blocks


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
    """Which blocks each virtual stage runs (virtual stage k = chunk * pp + pp_rank); an encoder-decoder's
    two lists form one chain (``lists``). See docs/design/pipeline-cut.md."""

    blocks_path: str  # an encoder-decoder's: its two paths joined by " + "
    ranges: list  # per virtual stage: (first block index, last block index)
    pp: int
    v: int
    lists: tuple = ()  # an encoder-decoder: ((encoder path, length), (decoder path, length))
    tied_head: bool = False  # an encoder-decoder whose head shares the embedding's weight
    companions: tuple = ()  # paths of lists walked with the blocks (zip): their i-th module goes with block i

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
        """Virtual stages that run each kind of module outside the blocks ("before", "between",
        "decoder_in", "after"). See docs/design/pipeline-cut.md."""
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
        return block_at(self.model.get_submodule(path), j)

    def __setitem__(self, i: int, module: nn.Module) -> None:
        path, j = self.layout.locate(i)
        set_block(self.model.get_submodule(path), j, module)

    def name(self, i: int) -> str:
        path, j = self.layout.locate(i)
        return f"{path}.{block_key(self.model.get_submodule(path), j)}"


def plan_stages(model: nn.Module, pp: int, v: int = 1, blocks=None, stage_layers=None,
                interleaved: bool = False) -> StageLayout:
    """Validate and assign; raises ValueError (same on every rank) before anything changes. ``blocks``:
    a block list's path, or an encoder-decoder's two (a list: encoder, then decoder)."""

    lists, tied_head, companions = (), False, ()
    pair = find_encoder_decoder(model)
    if blocks is None or (pair and blocks == pair[0]):
        blocks = pair or blocks  # naming the encoder's list (nn.TransformerEncoder's plan does) takes the pair
    if isinstance(blocks, (list, tuple)) and len(blocks) != 1:
        lists, tied_head = encoder_decoder(model, blocks, pp)
        path = " + ".join(p for p, _ in lists)
        module = [b for p, _ in lists for b in blocks_of(model.get_submodule(p))]
    else:
        path, container = find_blocks(model, blocks)
        group = [path] + zipped_with(model, path)
        if blocks is None:  # lists walked together: the blocks are the heaviest (not the norms beside them)
            path = max(group, key=lambda p: sum(t.numel() for t in model.get_submodule(p).parameters()))
            container = model.get_submodule(path)
        companions = tuple(p for p in group if p != path)
        module = blocks_of(container)
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
        with_companions = [[b] + [model.get_submodule(c)[i] for c in companions] for i, b in enumerate(module)]
        sizes = balanced_split([sum(p.numel() for m in ms for p in m.parameters()) or 1 for ms in with_companions],
                               parts)
    ranges, start = [], 0
    for size in sizes:
        ranges.append((start, start + size - 1))
        start += size
    return StageLayout(path, ranges, pp, v, lists, tied_head, companions)


@dataclass
class Cut:
    """What :func:`apply_split` left on a rank: its copies of tied weights, the modules it holds without
    running them in some chunks (name: (meta twin, runs)), and its interleaved blocks' meta twins."""

    tied: list = field(default_factory=list)
    silence: dict = field(default_factory=dict)
    twins: dict = field(default_factory=dict)  # block index: meta twin
    companion_twins: dict = field(default_factory=dict)  # (companion list path, index): meta twin


def apply_split(model: nn.Module, layout: StageLayout, pp_rank: int) -> Cut:
    """Replace what this rank does not own with placeholders; returns the :class:`Cut` (see
    docs/design/pipeline-cut.md)."""
    blocks = layout.blocks(model)
    mine = set()
    for k in layout.vstages_of(pp_rank):
        lo, hi = layout.ranges[k]
        mine.update(range(lo, hi + 1))
    groups = outer_groups(model, [p for p, _ in layout.lists] or [layout.blocks_path], layout.companions)
    params_before = {id(p) for _, m in groups["before"] for p in m.parameters()}
    if layout.lists:  # the decoder's copy of the embeddings (see StageLayout.runs)
        tied = [p for _, m in groups["before"] for p in m.parameters()] if len(layout.replica_ranks()) > 1 else []
    else:
        tied = [p for _, m in groups["after"] for p in m.parameters() if id(p) in params_before]
    # interleaved: this rank's blocks also run outside their stage (in its other chunks' runs), passing
    # their input through; the structure they return is worked out by a meta twin made before sharding
    twins = {i: meta_twin(blocks[i]) for i in sorted(mine)} if layout.v > 1 else {}
    companion_twins = {(c, i): meta_twin(model.get_submodule(c)[i]) for c in layout.companions
                       for i in sorted(mine)} if layout.v > 1 else {}
    for i in range(len(blocks)):
        if i not in mine:
            blocks[i] = skipped(blocks[i], blocks.name(i))
            for piece in blocks[i].modules():
                if isinstance(piece, SkippedBlock):
                    piece.side_outputs = bool(layout.lists)
            for c in layout.companions:
                beside = model.get_submodule(c)
                beside[i] = skipped(beside[i], f"{c}.{i}", piece=True)
    silence, my_vstages = {}, set(layout.vstages_of(pp_rank))
    encoder_only = _encoder_only(model, layout)
    for kind, runs in layout.runs().items():
        owned = bool(runs & my_vstages) or (kind == "before" and pp_rank in layout.replica_ranks())
        for name, m in groups[kind]:
            if not owned:
                model.set_submodule(name, ShapeOnly(m, name))
                model.get_submodule(name).runs_in = kind
                continue
            needed = {0} if kind == "before" and id(m) in encoder_only else runs
            if kind != "after" and my_vstages - needed:
                silence[name] = (meta_twin(m), needed)
            # run by two of its chunks, held without running, or an encoder-decoder's copy (parts of which
            # its stage may not use): no one backward pass finalizes the gradient (see ...dp.overlap)
            if len(runs & my_vstages) != 1 or (kind == "before" and len(layout.replica_ranks()) > 1):
                for p in m.parameters():
                    set_marks(p, pp_late_sync=True)
    order = {id(p): i for i, p in enumerate(p for _, m in groups["before"] for p in m.parameters())}
    for p in tied:  # numbered as in the unsplit model: every copy sums in one order (see grads._sum_tied)
        set_marks(p, pp_tied=True, pp_tied_index=order[id(p)], pp_copy=bool(layout.lists))
    holds_tied = pp_rank in (layout.replica_ranks() if layout.lists else (0, layout.pp - 1))
    return Cut(tied if holds_tied else [], silence, twins, companion_twins)


def _encoder_only(model: nn.Module, layout: StageLayout) -> set:
    """ids of the modules only an encoder-decoder's encoder input uses, which the decoder's copy of the
    first stage's modules need not run. See docs/design/pipeline-cut.md."""
    if not layout.lists:
        return set()
    encoder, decoder = (p.rpartition(".")[0] for p, _ in layout.lists)
    if not encoder or encoder == decoder or decoder.startswith(encoder + ".") or encoder.startswith(decoder + "."):
        return set()
    paths: dict = {}
    for name, m in model.named_modules(remove_duplicate=False):
        paths.setdefault(id(m), []).append(name)
    return {i for i, names in paths.items() if all(n.startswith(encoder + ".") for n in names)}
