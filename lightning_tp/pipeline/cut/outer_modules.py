"""Which stage runs each module outside the block lists: embeddings first, the rest where the block
list's parent calls it (read from its source), else by registration order."""

from __future__ import annotations

import inspect
import re

from torch import nn


def outer_groups(model: nn.Module, paths: list, companions=()) -> dict:
    """Top-most modules with parameters outside the block lists (and ``companions``) by where they run:
    "before", "after", and for an encoder-decoder "between" and "decoder_in". See docs/design/pipeline-cut.md."""
    groups, seen, taken = {"before": [], "between": [], "decoder_in": [], "after": []}, 0, list(companions)
    called = _called_around(model, paths[0]) if len(paths) == 1 else {}
    for name, m in model.named_modules():
        if name in paths:
            seen += 1
            taken.append(name)
            continue
        if not name or name in taken or any(name.startswith(t + ".") for t in taken) or any(p.startswith(name + ".") for p in paths):
            continue
        if any(True for _ in m.parameters(recurse=False)) or _is_leafy_owner(m):
            kind = "before" if _runs_first(m, seen > 0, called.get(name)) else "after"
            if kind == "after" and len(paths) == 2:
                kind = _encoder_decoder_kind(name, paths, seen)
            groups[kind].append((name, m))
            taken.append(name)
    return groups


def _encoder_decoder_kind(name: str, paths: list, seen: int) -> str:
    """Where a non-embedding module of an encoder-decoder runs, decided by the parent module it sits
    under (encoder's, decoder's, else registration order). See docs/design/pipeline-cut.md."""
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
    """Path -> "before" or "after": where the block list's parent calls each of its other children
    relative to its loop over the blocks, read from its source. See docs/design/pipeline-cut.md."""
    parent_path, _, leaf = blocks_path.rpartition(".")
    parent = model.get_submodule(parent_path)
    for method in ("forward", "training_step"):  # a LightningModule may loop over its blocks in its step
        try:
            source = inspect.getsource(getattr(type(parent), method))
        except (AttributeError, OSError, TypeError):
            continue
        loop = re.search(rf"\bin\s+(?:enumerate\(|zip\([^()]*?)?self\.{re.escape(leaf)}\b|self\.{re.escape(leaf)}\s*[\[(]",
                         source)
        if loop is not None:
            break
    else:
        return {}
    # the container called as a whole (self.norm(self.blocks(h))): a call around it runs after it
    at = (lambda m: _call_ends(source, m.end() - 1)) if loop.group().endswith("(") else (lambda m: m.start())
    helpers = _helper_sources(parent, source, at)
    out = {}
    for child, _ in parent.named_children():
        pattern = rf"\bself\.{re.escape(child)}\s*\("
        calls = [at(m) for m in re.finditer(pattern, source)]
        calls += [at for at, body in helpers if re.search(pattern, body)]  # called in a helper it calls
        if child != leaf and calls:
            path = f"{parent_path}.{child}" if parent_path else child
            out[path] = "before" if min(calls) < loop.start() else "after"
    return out


def _call_ends(source: str, opening: int) -> int:
    """Where the call whose ``(`` is at ``opening`` ends: it runs once its arguments have, so
    ``self.norm(self.blocks(h))`` calls the norm after the blocks."""
    depth = 0
    for at in range(opening, len(source)):
        depth += {"(": 1, ")": -1}.get(source[at], 0)
        if depth == 0:
            return at
    return opening


def _helper_sources(parent: nn.Module, source: str, at) -> list:
    """(where it is called, by ``at``, its source) of each method of the user's own classes that ``source`` calls
    (``self.finish(h)`` after the loop calling ``self.norm``); Lightning's and torch's are left out."""
    found = []
    for call in re.finditer(r"\bself\.([A-Za-z_]\w*)\s*\(", source):
        method = getattr(type(parent), call.group(1), None)
        module = getattr(inspect.getmodule(method), "__name__", "") if inspect.isfunction(method) else "torch"
        if module.split(".")[0] in ("torch", "lightning", "pytorch_lightning"):
            continue
        try:
            found.append((at(call), inspect.getsource(method)))
        except (OSError, TypeError):
            continue
    return found


def _is_leafy_owner(m: nn.Module) -> bool:
    """A module whose parameters all sit in children that are not containers of other blocks."""
    return any(True for _ in m.parameters()) and not any(isinstance(c, nn.ModuleList) for c in m.modules())

