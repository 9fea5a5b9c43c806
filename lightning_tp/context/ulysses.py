"""All-to-all (Ulysses) attention over the cp group: heads scattered and the sequence gathered, one
whole-sequence attention per rank on its heads, then the way back."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .chunks import chunk_ids


class _SequenceToHeads(torch.autograd.Function):
    """(B, H, n, D) with this rank's n tokens -> (B, H/cp, cp*n, D): every rank's tokens, in rank order,
    for this rank's heads; backward the reverse."""

    @staticmethod
    def forward(ctx, x, group, cp):
        ctx.group, ctx.cp = group, cp
        return _to_heads(x, group, cp)

    @staticmethod
    def backward(ctx, g):
        return _to_sequence(g, ctx.group, ctx.cp), None, None


class _HeadsToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, cp):
        ctx.group, ctx.cp = group, cp
        return _to_sequence(x, group, cp)

    @staticmethod
    def backward(ctx, g):
        return _to_heads(g, ctx.group, ctx.cp), None, None


def _to_heads(x, group, cp):
    b, h, n, d = x.shape
    send = x.reshape(b, cp, h // cp, n, d).transpose(0, 1).contiguous()  # [rank to] b, h/cp, n, d
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # [rank from] b, h/cp, n, d
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * n, d)


def _to_sequence(x, group, cp):
    b, hl, total, d = x.shape
    n = total // cp
    send = x.reshape(b, hl, cp, n, d).permute(2, 0, 1, 3, 4).contiguous()  # [rank to] b, h/cp, n, d
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # [rank from: its heads] b, h/cp, n, d
    return recv.transpose(0, 1).reshape(b, cp * hl, n, d)


def _order(cp: int, c: int, device) -> torch.Tensor:
    """Positions in rank order (rank 0's two chunks, rank 1's, ...) -> the global chunk order."""
    held = [i for r in range(cp) for i in chunk_ids(cp, r)]
    by_chunk = torch.empty(2 * cp, dtype=torch.long)
    by_chunk[torch.tensor(held)] = torch.arange(2 * cp)
    return (by_chunk.to(device).unsqueeze(1) * c + torch.arange(c, device=device)).reshape(-1)


def all_to_all_attention(sdpa, q, k, v, scale, causal: bool, group, cp: int) -> torch.Tensor:
    """``sdpa`` (torch's own) over the whole sequence for H/cp heads of this rank; q (B, H, 2c, D),
    k and v (B, H_kv, 2c, D) with H and H_kv divisible by cp."""
    c = q.shape[2] // 2
    order = _order(cp, c, q.device)
    back = torch.argsort(order)
    q, k, v = (_SequenceToHeads.apply(t, group, cp)[:, :, order] for t in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    out = sdpa(q, k, v, is_causal=causal, scale=scale)
    return _HeadsToSequence.apply(out[:, :, back].contiguous(), group, cp)
