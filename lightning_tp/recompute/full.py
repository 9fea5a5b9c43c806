"""Activation checkpointing of the model's repeated blocks (Megatron's "full" recompute; with an int n,
the first n blocks of each stage). See docs/design/rng-and-recompute.md."""

from __future__ import annotations

import contextlib
import types

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..pipeline.run import zb_checkpoint
from ..pipeline.cut.placeholders import no_cache, positional_names
from ..pipeline.cut.block_lists import block_at, block_key, called_parts, find_blocks, is_block_list



def check_option(value, quant, schedule: str | None = None, keep_recomputed: bool = False,
                 split_backward: bool = False) -> None:
    """Check ``activation_checkpointing`` (False or 0, True, or a positive int) and ``zb_keep_recomputed``
    against quantization and a split backward. See docs/design/rng-and-recompute.md."""
    split = schedule == "zb_h1" or (schedule is not None and (split_backward is True or split_backward == "drain"))
    if value == "selective":  # the attention core only (see lightning_tp.recompute.selective)
        if keep_recomputed:
            raise ValueError("MegaStrategy(zb_keep_recomputed=True) keeps whole blocks' recomputation; with "
                             "activation_checkpointing='selective' leave it False.")
        return
    if isinstance(value, bool) or value is None:
        ok = True
    else:
        ok = isinstance(value, int) and value >= 0
    if not ok:
        raise ValueError(f"MegaStrategy(activation_checkpointing={value!r}): use True (every block), False, a "
                         f"positive int n (the first n blocks of each pipeline stage), or 'selective' (each "
                         f"block's attention core).")
    if value and quant is not None:
        raise ValueError(f"MegaStrategy(activation_checkpointing=..., quant={quant!r}) is not supported: the "
                         f"recomputed forward would update the quantizers' activation ranges a second time. "
                         f"Use one of the two.")
    if keep_recomputed not in (True, False):
        raise ValueError(f"MegaStrategy(zb_keep_recomputed={keep_recomputed!r}): use True or False.")
    if keep_recomputed and not (value and split):
        raise ValueError(f"MegaStrategy(zb_keep_recomputed=True) applies to a split backward (schedule='zb_h1', or "
                         f"split_backward=True or 'drain'; the default 'auto' splits none where blocks are "
                         f"recomputed) with activation_checkpointing (here schedule={schedule!r}, "
                         f"split_backward={split_backward!r}, activation_checkpointing={value!r}): set them, or "
                         f"leave it False.")
    if value and split and not keep_recomputed and \
            getattr(torch.utils.checkpoint, "GraphExecGroup", None) is None:
        raise ValueError(f"MegaStrategy(activation_checkpointing=...) with a split backward (schedule={schedule!r}, "
                         f"split_backward={split_backward!r}) needs torch >= 2.10 (torch.utils.checkpoint."
                         f"GraphExecGroup; this is {torch.__version__}): without it the weight half would recompute "
                         f"each block once per backward call. Use schedule='1f1b' with split_backward=False, "
                         f"or zb_keep_recomputed=True (one recomputation, kept from B to W).")


def hf_checkpointing_modules(model: nn.Module, layout) -> list:
    """Modules with Hugging Face's gradient checkpointing on, in or around ``layout``'s block lists
    (a block, inside one, or a parent of a list; not a vision tower beside them)."""
    lists = [path for path, _ in layout.lists] if layout.lists else [layout.blocks_path]
    near = lambda name: any(name == p or p.startswith(name + ".") or name.startswith(p + ".")  # noqa: E731
                            for p in lists)
    return [m for name, m in model.named_modules() if near(name) and getattr(m, "gradient_checkpointing", False)
            is True and callable(getattr(m, "_gradient_checkpointing_func", None))]


def block_lists(model: nn.Module, name: str | None = None) -> list[str]:
    """Paths of the block lists to checkpoint without a pipeline: ``name``, else the outermost lists of
    same-class blocks. See docs/design/rng-and-recompute.md."""
    if name is not None:  # one path, or an encoder-decoder's two
        return [find_blocks(model, n)[0] for n in ([name] if isinstance(name, str) else name)]
    found = _outermost_lists(model, others=False) or _outermost_lists(model, others=True)
    if not found:
        raise ValueError(f"MegaStrategy(activation_checkpointing=...) checkpoints the model's repeated blocks (an "
                         f"nn.ModuleList, nn.Sequential or nn.ModuleDict of same-class blocks), and none was found in "
                         f"{type(model).__name__}. Name the list: MegaStrategy(activation_checkpointing=True, "
                         f"pipeline_blocks='path.to.blocks').")
    return found


def _outermost_lists(model: nn.Module, others: bool) -> list[str]:
    """Paths of the outermost block lists with trainable parameters (see pipeline.cut.block_lists)."""
    found = []
    for path, module in model.named_modules():
        if any(path.startswith(p + ".") for p in found):
            continue  # a list inside a block (experts, heads): its block is checkpointed whole
        if is_block_list(module, others) and any(p.requires_grad for p in module.parameters()):  # not metrics
            found.append(path)
    return found


def block_places(model: nn.Module, layout=None, pp_rank: int = 0, name: str | None = None,
                 first: int | None = None) -> list[tuple[str, int]]:
    """(list path, index) of this rank's blocks: under a pipeline ``layout`` its virtual stages' (the first
    ``first`` of each), else every block of the model's lists (the first ``first`` of each)."""
    if layout is not None:
        return [layout.locate(i) for k in layout.vstages_of(pp_rank)
                for i in range(layout.ranges[k][0], layout.ranges[k][1] + 1)[:first]]
    return [(path, i) for path in block_lists(model, name) for i in range(len(model.get_submodule(path)))[:first]]


def targets(model: nn.Module, n, layout=None, pp_rank: int = 0, name: str | None = None) -> list[tuple[str, int]]:
    """(list path, index) of each block to checkpoint: with a pipeline ``layout``, this rank's blocks
    (all of them, or the first ``n`` of each virtual stage); without, every block of the lists (or
    the first n of each list). Found before anything changes, so a bad model fails on every rank."""
    out = block_places(model, layout, pp_rank, name, None if n is True else n)
    block = lambda path, i: block_at(model.get_submodule(path), i)  # noqa: E731
    called = lambda path, i: f"{path}.{block_key(model.get_submodule(path), i)}"  # noqa: E731
    twice = [called(path, i) for path, i in out if getattr(block(path, i), "gradient_checkpointing", False)]
    if twice:
        from lightning.pytorch.utilities import rank_zero_warn

        rank_zero_warn(f"{twice[0]} (and {len(twice) - 1} more) already recompute with Hugging Face's gradient "
                       f"checkpointing; MegaStrategy(activation_checkpointing=...) recomputes them a second time. "
                       f"Turn one off (model.gradient_checkpointing_disable()).")
    for path, i in out:
        stateful = next((f"{called(path, i)}.{sub}".rstrip(".") for sub, m in block(path, i).named_modules()
                         if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats), None)
        if stateful is not None:
            raise ValueError(f"MegaStrategy(activation_checkpointing=...): {stateful} keeps running statistics, "
                             f"which the recomputed forward would update a second time. Use "
                             f"activation_checkpointing=False, or an int n that leaves block {i} out.")
    return out


def apply(model: nn.Module, blocks: list[tuple[str, int]], split: bool = False) -> None:
    """Wrap each listed block's forward in a non-reentrant checkpoint (``split``: the zero-bubble checkpoint
    that keeps B's recomputation for W). See docs/design/rng-and-recompute.md."""
    for path, i in blocks:
        for _, block in called_parts(block_at(model.get_submodule(path), i)):
            _checkpoint(block, split)


def _checkpoint(block: nn.Module, split: bool) -> None:
    block._lightning_tp_inner_forward = block.forward
    block._lightning_tp_split_checkpoint = split
    block._lightning_tp_positional = positional_names(block)
    block.forward = types.MethodType(_checkpointed_forward, block)
    block._lightning_tp_recompute = True


def _checkpointed_forward(self, *args, **kwargs):
    inner = self._lightning_tp_inner_forward
    if not torch.is_grad_enabled():  # validation, prediction: nothing to save
        return inner(*args, **kwargs)
    names = self._lightning_tp_positional
    args = tuple(no_cache(names[i], a) if i < len(names) else a for i, a in enumerate(args))
    kwargs = {k: no_cache(k, v) for k, v in kwargs.items()}  # the recompute would update a cache again
    keys, n = tuple(kwargs), len(args)

    calls = [0]

    def run(*flat):
        calls[0] += 1
        streams = self.__dict__.get("_lightning_tp_streams")  # under tp/pp: see lightning_tp/recompute/rng.py
        replay = streams is not None and calls[0] > 1  # the recompute (in backward, or ZB's weight half)
        with streams.recomputing("") if replay else contextlib.nullcontext():
            return inner(*flat[:n], **dict(zip(keys, flat[n:])))

    if self._lightning_tp_split_checkpoint:
        return zb_checkpoint.checkpoint(run, self, (*args, *kwargs.values()))
    return checkpoint(run, *args, *kwargs.values(), use_reentrant=False)
