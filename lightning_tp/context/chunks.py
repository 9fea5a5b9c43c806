"""Load-balanced sequence chunks: the sequence is cut into 2*cp chunks and cp rank r keeps chunks r
and 2*cp-1-r, so every rank does the same causal attention work; a batch's sequence tensors are cut so."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection


def chunk_ids(cp: int, rank: int) -> tuple:
    """The two global chunk indices cp rank ``rank`` holds, in the order it holds them."""
    return rank, 2 * cp - 1 - rank


def check_length(length: int, cp: int) -> None:
    """An error naming the nearest lengths that work when 2*cp does not divide ``length``."""
    step = 2 * cp
    if length % step:
        below, above = length - length % step, length - length % step + step
        near = f"{below} or {above}" if below else f"{above}"
        raise ValueError(f"MegaStrategy(cp={cp}) cuts each sequence into 2*cp={step} chunks, but this batch's "
                         f"sequence length is {length}: use a length divisible by {step} (e.g. {near}), by padding "
                         f"or cropping in your collate_fn.")


def global_positions(length: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """The global positions (0 .. length-1) of the tokens cp rank ``rank`` holds, in its order."""
    c = length // (2 * cp)
    return torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in chunk_ids(cp, rank)])


def sequence_length(batch) -> int:
    """The sequence length of a batch: dim 1 of its first tensor with at least two dimensions."""
    found = []
    apply_to_collection(batch, torch.Tensor, lambda t: found.append(t) if t.dim() >= 2 else None)
    if not found:
        raise ValueError("MegaStrategy(cp > 1) cuts the sequence dimension (dim 1) of the batch's tensors, but "
                         "this batch has no tensor with two or more dimensions. Batches must hold (batch, "
                         "sequence, ...) tensors such as input ids and labels.")
    return found[0].shape[1]


def cut_batch(batch, cp: int, rank: int):
    """Every tensor of ``batch`` whose dim 1 is the sequence length keeps this rank's two chunks;
    others (per-sample values) stay whole. Returns (cut batch, sequence length)."""
    length = sequence_length(batch)
    check_length(length, cp)
    _check_right_padded(batch)
    c = length // (2 * cp)

    def cut(t: torch.Tensor) -> torch.Tensor:
        if t.dim() < 2 or t.shape[1] != length:
            return t
        return torch.cat([t[:, i * c:(i + 1) * c] for i in chunk_ids(cp, rank)], dim=1)

    return apply_to_collection(batch, torch.Tensor, cut), length


def _check_right_padded(batch) -> None:
    """A batch's ``attention_mask`` (a dict entry) must pad on the right only: causal attention then
    keeps real tokens apart from pads without the mask, which the ring does not cut."""
    mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        return
    keep = mask.bool().int()
    if bool((keep[:, 1:] > keep[:, :-1]).any()):
        raise ValueError("MegaStrategy(cp > 1): this batch's attention_mask has a padded (0) position before a "
                         "real (1) one: left padding or holes. Context parallelism supports right padding only; "
                         "pad on the right (tokenizer.padding_side = 'right').")
