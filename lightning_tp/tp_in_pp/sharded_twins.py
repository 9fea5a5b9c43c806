"""Meta twins sharded as this rank's modules are (the tp plan applied without a group), so that their stand-ins
have this rank's shapes. See docs/design/pipeline-tp-in-pp.md.
"""

from __future__ import annotations

from torch import nn

from ..plans import swap
from ..pipeline.cut.block_lists import block_key
from ..pipeline.cut.placeholders import PipelinePlaceholder


def shard_twins(module: nn.Module, layout, split, matches: list, tp: int, rank: int) -> None:
    """Shard every twin the split made (see :func:`..pipeline.cut.split.apply_split`) as tp rank ``rank``'s
    modules, in place: placeholders' twins and the Cut ``split``'s silence, twins and companion_twins. After
    the model's own sharding, before the stage wrappers take the twins."""
    for name, m in module.named_modules():
        if isinstance(m, PipelinePlaceholder):
            m._twin[0] = _sharded(name, m._twin[0], matches, tp, rank)
    blocks = layout.blocks(module)
    split.twins = {i: _sharded(blocks.name(i), twin, matches, tp, rank) for i, twin in split.twins.items()}
    split.silence = {name: (_sharded(name, twin, matches, tp, rank), runs)
                     for name, (twin, runs) in split.silence.items()}
    split.companion_twins = {
        (c, i): _sharded(f"{c}.{block_key(module.get_submodule(c), i)}", twin, matches, tp, rank)
        for (c, i), twin in split.companion_twins.items()}


def _sharded(path: str, twin: nn.Module, matches: list, tp: int, rank: int) -> nn.Module:
    """``twin`` (or what replaced it) after the plan's entries under ``path`` are applied to it, placed at
    ``path`` in a tree of empty modules so that the plan's paths find it. See
    docs/design/pipeline-tp-in-pp.md."""
    root = node = nn.Module()
    *parents, leaf = path.split(".")
    for part in parents:
        child = nn.Module()
        node.add_module(part, child)
        node = child
    node.add_module(leaf, twin)
    mine = [m for m in matches if not m.prefix or path == m.prefix or path.startswith(m.prefix + ".")]
    swap.apply(root, mine, None, tp, rank, False)
    out = root.get_submodule(path)
    if out is not twin and hasattr(twin, "_lightning_tp_name"):
        out._lightning_tp_name = twin._lightning_tp_name
    return out
