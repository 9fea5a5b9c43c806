"""Meta twins sharded as this rank's modules are, so that their stand-ins have this rank's shapes.

A split keeps a meta twin of each module another stage holds (a placeholder's), of the modules it
holds whose reruns in another chunk are silenced, and of its own blocks for their pass-through
under the interleaved schedule. The twins are made before tensor parallelism shards the model,
and a twin's output stands in for the real module's. Where tp changes an output's shape, the
stand-in then has the whole model's: T5's first block returns the position bias of every head,
where under tp each rank computes its own heads' (its ``relative_attention_bias`` is split per
head), and an encoder-decoder stage hands that bias on with its hidden states; a receiving stage
unpacks the message by the shapes its own code computed from the stand-ins, and the sizes did not
add up. So after the model's sharding each twin gets the same plan, applied without a group: the
same modules replaced, the same attributes divided (``n_heads``), no collective in its meta runs.
"""

from __future__ import annotations

from torch import nn

from ..plans import apply as planner
from ..pipeline.cut.block_lists import block_key
from ..pipeline.cut.placeholders import PipelinePlaceholder


def shard_twins(module: nn.Module, layout, split: dict, matches: list, tp: int, rank: int) -> None:
    """Shard every twin the split made (see :func:`.split.apply_split`) as tp rank ``rank``'s modules,
    in place: placeholders' twins and the entries of ``split``'s "silence", "twins" and
    "companion_twins". After the model's own sharding, before the stage wrappers take the twins."""
    for name, m in module.named_modules():
        if isinstance(m, PipelinePlaceholder):
            m._twin[0] = _sharded(name, m._twin[0], matches, tp, rank)
    blocks = layout.blocks(module)
    split["twins"] = {i: _sharded(blocks.name(i), twin, matches, tp, rank) for i, twin in split["twins"].items()}
    split["silence"] = {name: (_sharded(name, twin, matches, tp, rank), runs)
                        for name, (twin, runs) in split["silence"].items()}
    split["companion_twins"] = {
        (c, i): _sharded(f"{c}.{block_key(module.get_submodule(c), i)}", twin, matches, tp, rank)
        for (c, i), twin in split.get("companion_twins", {}).items()}


def _sharded(path: str, twin: nn.Module, matches: list, tp: int, rank: int) -> nn.Module:
    """``twin`` (or what replaced it) after the plan's entries under ``path`` are applied to it, placed at
    ``path`` in a tree of empty modules so that the plan's paths find it. Without sequence parallelism:
    a stand-in's sequence length comes from its arguments (see placeholders.passthrough), which stay
    whole on the runs that pass stand-ins through; where an encoder-decoder's stage receives shards,
    it unpacks them by the shard's shape (see .sp_stages)."""
    root = node = nn.Module()
    *parents, leaf = path.split(".")
    for part in parents:
        child = nn.Module()
        node.add_module(part, child)
        node = child
    node.add_module(leaf, twin)
    mine = [m for m in matches if not m.prefix or path == m.prefix or path.startswith(m.prefix + ".")]
    planner.apply(root, mine, None, tp, rank, False)
    out = root.get_submodule(path)
    if out is not twin and hasattr(twin, "_lightning_tp_name"):
        out._lightning_tp_name = twin._lightning_tp_name
    return out
