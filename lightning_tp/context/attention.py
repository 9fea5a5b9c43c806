"""torch's ``scaled_dot_product_attention`` made context-parallel while a cp run is active: the mask read
(causal, causal with right padding, or none; agreed over cp at each attention module's first call, then
checked locally), then the ring or the all-to-all."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import comm
from .ring import ring_attention
from .state import active
from .ulysses import all_to_all_attention

SDPA = F.scaled_dot_product_attention  # torch's own, whatever is installed in its place


def context_parallel_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                          enable_gqa=False):
    """Drop-in for ``F.scaled_dot_product_attention``: torch's own outside a cp step."""
    run = active()
    if run is None or run.length is None:
        return SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                    enable_gqa=enable_gqa)
    n = query.shape[-2]
    where = run.current or "an attention module"
    if query.dim() != 4 or key.shape[-2] != n or n * run.cp != run.length:
        raise ValueError(f"MegaStrategy(cp={run.cp}): {where} called scaled_dot_product_attention with "
                         f"{n} queries and {key.shape[-2]} keys, but each cp rank holds {run.length // run.cp} "
                         f"tokens of a {run.length}-token sequence: only self-attention over the cut sequence "
                         f"is context-parallel (cross-attention and other lengths are not).")
    if dropout_p:
        raise ValueError(f"MegaStrategy(cp={run.cp}): {where} uses attention dropout ({dropout_p}), which "
                         f"context-parallel attention does not apply. Set the model's attention dropout to 0.")
    first = where not in run.agreed
    if first:  # one collective per attention module and run
        run.agreed[where] = _agree(run, attn_mask, is_causal, n, key.shape[1], query.device, where)
    causal, kv_heads = run.agreed[where]
    if not first:  # this rank's own reading must say the same
        _check(run, attn_mask, is_causal, n, causal, where)
    if key.shape[1] != kv_heads:  # Hugging Face repeats K/V heads where it passes a mask (padded ranks only):
        key, value = _heads_as(key, kv_heads), _heads_as(value, kv_heads)  # every rank sends as many
    scale = scale if scale is not None else 1.0 / math.sqrt(query.shape[-1])
    run.calls += 1
    if run.mode == "all_to_all":
        for name, heads in (("query", query.shape[1]), ("key/value", key.shape[1])):
            if heads % run.cp:
                raise ValueError(f"MegaStrategy(cp={run.cp}, cp_attention='all_to_all') scatters heads over the cp "
                                 f"ranks, but {where} has {heads} {name} heads (query {query.shape[1]}, key/value "
                                 f"{key.shape[1]}): use cp dividing both, or cp_attention='ring'.")
        return all_to_all_attention(SDPA, query, key, value, scale, causal, run.group, run.cp)
    return ring_attention(query, key, value, scale, causal, run.group, run.cp, run.rank, run.next, run.prev)


def _heads_as(t: torch.Tensor, heads: int) -> torch.Tensor:
    """``t``'s K/V heads repeated (Hugging Face's repeat_kv: each head ``groups`` times in a row) or un-repeated
    to ``heads``."""
    if t.shape[1] < heads:
        return t.repeat_interleave(heads // t.shape[1], dim=1)
    return t[:, ::t.shape[1] // heads]


def _check(run, mask, is_causal: bool, n: int, causal: bool, where: str) -> None:
    """This rank's reading of a later call against the agreed one (no collective: the common case, no mask,
    reads nothing from the device). A rank that disagrees raises; the others then lose it as a peer."""
    if mask is None:
        ok = bool(is_causal) == causal
    else:
        causal_ok, none = _read(mask, is_causal, n)
        ok = causal_ok if causal else none
    if not ok:
        raise ValueError(f"MegaStrategy(cp={run.cp}): {where} gave scaled_dot_product_attention a mask that reads "
                         f"{'causal' if not causal else 'neither causal, causal with right padding, nor empty'} on cp "
                         f"rank {run.rank}, where its first call read {'causal' if causal else 'no mask'}: a sliding "
                         f"window, document mask, left padding or additive bias on some batches. Context parallelism "
                         f"supports causal attention with right padding; use cp=1 for this model.")


def _agree(run, mask, is_causal: bool, n: int, kv_heads: int, device, where: str) -> tuple:
    """(causal or not, K/V heads every rank sends: the fewest), agreed over the cp group at an attention module's
    first call; a rank without padding gets no mask from Hugging Face, nor repeated K/V heads. A mask reads as
    causal (right padding hidden from the padded rows only) or none, else it is refused on every rank."""
    flags = torch.tensor(_read(mask, is_causal, n) + [kv_heads], device=device)
    flags = comm.all_reduce(flags, run.group, op=dist.ReduceOp.MIN)
    if not flags[0] and not flags[1]:
        raise ValueError(f"MegaStrategy(cp={run.cp}): {where} gave scaled_dot_product_attention a mask that is "
                         f"neither causal, causal with right padding, nor empty (a sliding window, document mask, "
                         f"left padding or an additive bias such as ALiBi) on some cp rank. Context parallelism "
                         f"supports causal attention with right padding; use cp=1 for this model.")
    return bool(flags[0]), int(flags[2])


def _read(mask, is_causal: bool, n: int) -> list:
    """[causal or causal with right padding, no mask at all] for this rank's mask, as 0/1."""
    if mask is None:
        return [int(bool(is_causal)), int(not is_causal)]
    if mask.dtype == torch.bool:
        allowed, additive_ok = mask, True
    else:
        blocked = mask <= torch.finfo(mask.dtype).min / 2
        allowed, additive_ok = mask == 0, bool((blocked | (mask == 0)).all())
    allowed = allowed.expand(*allowed.shape[:-2], n, n).reshape(-1, n, n)
    tril = torch.ones(n, n, dtype=torch.bool, device=allowed.device).tril()
    if is_causal:
        allowed = allowed & tril
    real = allowed.diagonal(dim1=-2, dim2=-1).unsqueeze(-1)  # rows of kept tokens
    causal_ok = additive_ok and not bool((allowed & ~tril).any()) and bool(((allowed == tril) | ~real).all())
    return [int(causal_ok), int(additive_ok and bool(allowed.all()))]
