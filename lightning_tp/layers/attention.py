"""A tensor-parallel stand-in for ``nn.MultiheadAttention`` that takes over its weights: heads split
over tp, same call signature and return value. See docs/design/tensor-parallel.md."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from .linear import RowParallelLinear, TPContext, shard_param
from .shard import ShardSpec, check_divisible


def _float_mask(mask, dtype):
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask, float("-inf"))
    return mask.to(dtype)


class TPMultiheadAttention(nn.Module):
    _warned_weights = False

    def __init__(self, in_proj_weight, in_proj_bias, out_proj, ctx: TPContext, num_heads, embed_dim, dropout,
                 batch_first):
        super().__init__()
        self.in_proj_weight, self.in_proj_bias, self.out_proj, self.ctx = in_proj_weight, in_proj_bias, out_proj, ctx
        self.num_heads, self.embed_dim, self.dropout, self.batch_first = num_heads, embed_dim, dropout, batch_first
        self.local_heads = num_heads // ctx.world
        self.head_dim = embed_dim // num_heads
        self.whole_memory = False  # a cross-attention's key and value whole under SP: they enter by copy
        # Read by nn.TransformerEncoder(Layer): False keeps them off their fused fast path,
        # which would run the local shards as if they were the whole layer.
        self._qkv_same_embed_dim = False

    @classmethod
    def from_module(cls, mha: nn.MultiheadAttention, ctx: TPContext, name: str, memo: dict):
        if not mha._qkv_same_embed_dim:
            raise ValueError(f"{name}: nn.MultiheadAttention with kdim/vdim != embed_dim is not supported under tp; "
                             f"leave it replicated in the plan.")
        if mha.bias_k is not None or mha.add_zero_attn:
            raise ValueError(f"{name}: add_bias_kv / add_zero_attn are not supported under tp.")
        check_divisible("num_heads", name, mha.num_heads, ctx.world,
                        f"Use a number of heads divisible by tp, or tp dividing {mha.num_heads}.")
        spec = ShardSpec(dim=0, world=ctx.world, full=3 * mha.embed_dim, chunks=3)
        weight = shard_param(mha.in_proj_weight, spec, ctx, memo)
        bias = shard_param(mha.in_proj_bias, spec, ctx, memo) if mha.in_proj_bias is not None else None
        out_proj = RowParallelLinear.from_linear(mha.out_proj, ctx, f"{name}.out_proj", memo)
        return cls(weight, bias, out_proj, ctx, mha.num_heads, mha.embed_dim, mha.dropout, mha.batch_first)

    def _heads(self, x):
        b, t, _ = x.shape
        return x.view(b, t, self.local_heads, self.head_dim).transpose(1, 2)

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        if need_weights and not TPMultiheadAttention._warned_weights:
            TPMultiheadAttention._warned_weights = True
            warnings.warn("lightning_tp: attention weights are not returned under tensor parallelism "
                          "(need_weights=True returns None); pass need_weights=False to silence this.")
        self_attention, shared_kv = query is key and key is value, key is value
        if not self.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        w = self.in_proj_weight.chunk(3)
        b = self.in_proj_bias.chunk(3) if self.in_proj_bias is not None else (None, None, None)
        if self_attention:
            q, k, v = F.linear(self.ctx.enter_region(query), self.in_proj_weight, self.in_proj_bias).chunk(3, -1)
        else:  # cross-attention: the memory enters once for k and v (one backward all-reduce, not two)
            q = F.linear(self.ctx.enter_region(query), w[0], b[0])
            enter = self.ctx.enter_whole if self.whole_memory else self.ctx.enter_region
            memory = enter(key) if shared_kv else None
            k = F.linear(memory if memory is not None else enter(key), w[1], b[1])
            v = F.linear(memory if memory is not None else enter(value), w[2], b[2])
        q, k, v = self._heads(q), self._heads(k), self._heads(v)
        mask = self._mask(attn_mask, key_padding_mask, q)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0,
                                             is_causal=bool(is_causal and mask is None))
        out = out.transpose(1, 2).reshape(out.shape[0], out.shape[2], self.local_heads * self.head_dim)
        out = self.out_proj(out)
        if not self.batch_first:
            out = out.transpose(0, 1)
        return out, None

    def _mask(self, attn_mask, key_padding_mask, q):
        attn = _float_mask(attn_mask, q.dtype)
        if attn is not None and attn.dim() == 3:  # (batch * heads, T, S): keep this rank's heads
            bsz = q.shape[0]
            attn = attn.view(bsz, self.num_heads, *attn.shape[1:])
            attn = attn[:, self.ctx.rank * self.local_heads:(self.ctx.rank + 1) * self.local_heads]
        pad = _float_mask(key_padding_mask, q.dtype)
        if pad is not None:
            pad = pad[:, None, None, :]
            attn = pad if attn is None else attn + pad
        return attn

    def extra_repr(self):
        return f"embed_dim={self.embed_dim}, heads={self.local_heads}/{self.num_heads}, tp={self.ctx.world}"
