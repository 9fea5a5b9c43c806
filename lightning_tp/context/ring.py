"""Ring attention over the cp group: K/V travel around the ring (the next block's transfer overlapped
with this block's attention), partial outputs merge by log-sum-exp, blocks above the causal diagonal
are skipped; in backward dK/dV travel with their K/V back to the rank that owns them."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import comm
from . import blocks
from .chunks import chunk_ids

KV_TAG, GRAD_TAG = 41, 42


def _relation(q_chunk: int, k_chunk: int, causal: bool):
    """'full', 'diag' or None (nothing: the key chunk is after the query chunk)."""
    if not causal or k_chunk < q_chunk:
        return "full"
    return "diag" if k_chunk == q_chunk else None


def _exchange(send: torch.Tensor, recv: torch.Tensor, ring, tag: int) -> list:
    """Send to the next rank, receive from the previous one; returns the requests to wait on."""
    group, nxt, prev = ring
    comm.record("ring_send", send, group)
    ops = [dist.P2POp(dist.isend, send, nxt, group, tag), dist.P2POp(dist.irecv, recv, prev, group, tag)]
    return dist.batch_isend_irecv(ops)


def _wait(requests: list) -> None:
    for r in requests:
        r.wait()


def _pack(*tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _unpack(flat: torch.Tensor, like: tuple) -> list:
    out, at = [], 0
    for shape in like:
        n = 1
        for d in shape:
            n *= d
        out.append(flat[at:at + n].view(shape))
        at += n
    return out


def _heads(t: torch.Tensor, groups: int) -> torch.Tensor:
    """Key/value heads repeated for grouped-query attention (query head h reads key head h // groups)."""
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _fold(t: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of :func:`_heads`: summed over each key head's query heads."""
    if groups == 1:
        return t
    b, h, n, d = t.shape
    return t.view(b, h // groups, groups, n, d).sum(2)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, causal, ring, cp, cp_rank):
        groups = q.shape[1] // k.shape[1]
        c = q.shape[2] // 2
        b, h, n, _ = q.shape  # the output laid out (B, T, H, D), as torch's kernels make it: the usual
        out = torch.zeros(b, n, h, v.shape[-1], dtype=torch.float32, device=q.device).transpose(1, 2)  # reshape is a view
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        shapes = (k.shape, v.shape)
        held = _pack(k, v)
        mine, filled = chunk_ids(cp, cp_rank), set()
        for step in range(cp):
            source = (cp_rank - step) % cp
            if step < cp - 1:
                incoming = torch.empty_like(held)
                requests = _exchange(held, incoming, ring, KV_TAG)
            kk, vv = (_heads(t, groups) for t in _unpack(held, shapes))
            for i, qc in enumerate(mine):
                for j, kc in enumerate(chunk_ids(cp, source)):
                    kind = _relation(qc, kc, causal)
                    if kind is None:
                        continue
                    rows = slice(i * c, (i + 1) * c)
                    o, l = blocks.forward(q[:, :, rows], kk[:, :, j * c:(j + 1) * c], vv[:, :, j * c:(j + 1) * c],
                                          kind == "diag", scale)
                    blocks.merge(out[:, :, rows], lse[:, :, rows], o, l, first=i not in filled)
                    filled.add(i)
            if step < cp - 1:
                _wait(requests)
                held = incoming
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.causal, ctx.ring, ctx.cp, ctx.cp_rank = scale, causal, ring, cp, cp_rank
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        cp, cp_rank, ring, scale = ctx.cp, ctx.cp_rank, ctx.ring, ctx.scale
        groups, c = q.shape[1] // k.shape[1], q.shape[2] // 2
        shapes = (k.shape, v.shape)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        if blocks.kernel(q) != "math":  # the fused kernels take them in q's dtype: converted once, not per block
            dout, out = dout.to(q.dtype), out.to(q.dtype)
        lses = [lse[:, :, i * c:(i + 1) * c].contiguous() for i in range(2)]
        held = _pack(k, v)
        mine = chunk_ids(cp, cp_rank)
        grads_in = None  # (requests, buffer): the held block's dK/dV summed by the ranks it visited before
        for step in range(cp):
            source = (cp_rank - step) % cp
            if step < cp - 1:
                incoming = torch.empty_like(held)
                kv_requests = _exchange(held, incoming, ring, KV_TAG)
            kk, vv = (_heads(t, groups) for t in _unpack(held, shapes))
            dk = torch.zeros(kk.shape, dtype=torch.float32, device=q.device)
            dv = torch.zeros(vv.shape, dtype=torch.float32, device=q.device)
            for i, qc in enumerate(mine):
                for j, kc in enumerate(chunk_ids(cp, source)):
                    kind = _relation(qc, kc, ctx.causal)
                    if kind is None:
                        continue
                    rows, cols = slice(i * c, (i + 1) * c), slice(j * c, (j + 1) * c)
                    a, b, g = blocks.backward(dout[:, :, rows], q[:, :, rows], kk[:, :, cols], vv[:, :, cols],
                                              out[:, :, rows], lses[i], kind == "diag", scale)
                    dq[:, :, rows] += a
                    dk[:, :, cols] += b
                    dv[:, :, cols] += g
            grads = _pack(_fold(dk, groups), _fold(dv, groups))
            if grads_in is not None:
                _wait(grads_in[0])
                grads += grads_in[1]
            buffer = torch.empty_like(grads)
            grads_in = (_exchange(grads, buffer, ring, GRAD_TAG), buffer, grads)  # the last step: to the owner
            if step < cp - 1:
                _wait(kv_requests)
                held = incoming
        _wait(grads_in[0])
        dk, dv = _unpack(grads_in[1], shapes)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def ring_attention(q, k, v, scale: float, causal: bool, group, cp: int, cp_rank: int, next_rank: int,
                   prev_rank: int) -> torch.Tensor:
    """Attention of this rank's queries (B, H, 2c, D) over the whole sequence's keys and values (held as
    (B, H_kv, 2c, D) by every cp rank); ``next_rank`` / ``prev_rank``: global ranks around the ring."""
    return _RingAttention.apply(q, k, v, scale, causal, (group, next_rank, prev_rank), cp, cp_rank)
