"""A model's repeated block list (``nn.ModuleList``, ``nn.Sequential`` or ``nn.ModuleDict``): found, and
read and replaced by position; blocks called piece by piece and lists zipped with it. See docs/design/pipeline-cut.md.
"""

from __future__ import annotations

import inspect
import re

from torch import nn

CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)
PIECEWISE = (nn.ModuleList, nn.ModuleDict)  # a block of these is called piece by piece


def called_parts(block: nn.Module, name: str = "") -> list:
    """(path below the block, module) of what the user's code calls when the block runs: the block
    itself, or each piece of a block that is an ``nn.ModuleList`` / ``nn.ModuleDict`` (recursively)."""
    if not isinstance(block, PIECEWISE):
        return [(name, block)]
    return [part for key, child in block.named_children()
            for part in called_parts(child, f"{name}.{key}" if name else key)]


def blocks_of(container: nn.Module) -> list:
    return list(container.values()) if isinstance(container, nn.ModuleDict) else list(container)


def block_key(container: nn.Module, j: int) -> str:
    """The name of the j-th block in its container (``"3"``, or a ModuleDict's key)."""
    return list(container.keys())[j] if isinstance(container, nn.ModuleDict) else str(j)


def block_at(container: nn.Module, j: int) -> nn.Module:
    return container[block_key(container, j)] if isinstance(container, nn.ModuleDict) else container[j]


def set_block(container: nn.Module, j: int, module: nn.Module) -> None:
    if isinstance(container, nn.ModuleDict):
        container[block_key(container, j)] = module  # in place: the dict keeps its order
    else:
        container[j] = module


def is_block_list(module: nn.Module, others: bool = True) -> bool:
    """Two or more modules of one class: a model's repeated blocks. In an ``nn.ModuleList``, or (with
    ``others``) in an ``nn.Sequential`` or ``nn.ModuleDict`` when they are blocks of their own (they
    have children: not ``nn.Sequential(nn.Linear, nn.Linear)`` or a dict of task heads)."""
    if not isinstance(module, CONTAINERS if others else nn.ModuleList):
        return False
    blocks = blocks_of(module)
    if len(blocks) < 2 or len({type(b) for b in blocks}) != 1:
        return False
    if isinstance(module, nn.ModuleList):
        return True
    # blocks of their own, callable (a dict of ModuleLists holds lists, not blocks)
    return not isinstance(blocks[0], (nn.ModuleList, nn.ModuleDict)) and any(True for _ in blocks[0].children())


def find_blocks(model: nn.Module, name: str | None = None) -> tuple[str, nn.Module]:
    """(path, container) of the pipeline's block list: ``name``, else the longest outermost
    ``nn.ModuleList`` of blocks, else the longest outermost other container of them."""
    if isinstance(name, (list, tuple)) and len(name) == 1:
        name = name[0]
    if name is not None:
        try:
            blocks = model.get_submodule(name)
        except AttributeError:
            raise ValueError(f"pipeline_blocks={name!r}: no such module in {type(model).__name__}.") from None
        if not isinstance(blocks, CONTAINERS):
            raise ValueError(f"pipeline_blocks={name!r} is a {type(blocks).__name__}, not an nn.ModuleList, "
                             f"nn.Sequential or nn.ModuleDict of blocks.")
        return name, blocks
    best = _longest(model, others=False) or _longest(model, others=True)
    if best is None:
        raise ValueError(
            f"pipeline parallelism needs the model's repeated block list (an nn.ModuleList, nn.Sequential or "
            f"nn.ModuleDict of same-class blocks), and none was found in {type(model).__name__}. Name it: "
            f"MegaStrategy(pp=..., pipeline_blocks='path.to.blocks').")
    return best


def _longest(model: nn.Module, others: bool):
    """(path, container) of the longest outermost block list, ModuleLists only unless ``others``."""
    best, found = None, []
    for path, module in model.named_modules():
        if any(path.startswith(p + ".") for p in found):
            continue  # a list inside a block (an MoE block's experts, heads): never the pipeline's
        if is_block_list(module, others):
            found.append(path)
            if best is None or len(module) > len(best[1]):
                best = (path, module)
    return best


def zipped_with(model: nn.Module, path: str) -> list:
    """Paths of the lists the block list's parent walks together with it, read from its ``forward`` (or
    ``training_step``): siblings of the same length named with it in one ``zip(self.blocks, self.norms)``.
    Their i-th modules run with block i, so they go with it, to its stage."""
    parent_path, _, leaf = path.rpartition(".")
    parent = model.get_submodule(parent_path)
    n, out = len(model.get_submodule(path)), []
    for method in ("forward", "training_step"):
        try:
            source = inspect.getsource(getattr(type(parent), method))
        except (AttributeError, OSError, TypeError):
            continue
        for call in re.finditer(r"\bzip\(([^()]*)\)", source):
            names = re.findall(r"\bself\.([A-Za-z_]\w*)\b(?!\s*[.\[(])", call.group(1))
            for name in names if leaf in names else ():
                other = parent._modules.get(name)
                sibling = f"{parent_path}.{name}" if parent_path else name
                if name != leaf and isinstance(other, nn.ModuleList) and len(other) == n and sibling not in out:
                    out.append(sibling)
    return out
