"""Vocab-parallel embedding: each rank holds a contiguous slice of the vocabulary.
See docs/design/tensor-parallel.md."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import comm
from .linear import TPContext, shard_param
from .shard import ShardSpec, padded_size


class VocabParallelEmbedding(nn.Module):
    def __init__(self, weight, ctx: TPContext, num_embeddings: int, padding_idx=None, embed_scale=None):
        super().__init__()
        self.weight, self.ctx = weight, ctx
        if isinstance(embed_scale, torch.Tensor):  # a buffer (Gemma's): follows .to() and dtype changes
            self.register_buffer("embed_scale", embed_scale.detach().clone(), persistent=False)
        else:
            self.embed_scale = embed_scale
        self.num_embeddings, self.embedding_dim = num_embeddings, weight.shape[1]
        self.per_rank = weight.shape[0]
        self.vocab_start = ctx.rank * self.per_rank
        self.padding_idx = padding_idx

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, ctx: TPContext, name: str, memo: dict):
        if emb.max_norm is not None or emb.scale_grad_by_freq or emb.sparse:
            raise ValueError(f"{name}: nn.Embedding with max_norm, scale_grad_by_freq or sparse=True cannot be "
                             f"vocab-parallel; leave it replicated (style 'replicate') or drop the option.")
        # a subclass's own forward would be lost; Hugging Face's scaled embeddings (BART's) multiply by
        # embed_scale, which is kept. Anything else is refused rather than silently changed.
        own_forward = type(emb).forward is not nn.Embedding.forward
        scale = getattr(emb, "embed_scale", None) if own_forward else None
        if own_forward and scale is None:
            raise ValueError(f"{name}: {type(emb).__name__} has its own forward, which a vocab-parallel embedding "
                             f"would not run; leave it replicated (style 'replicate').")
        vocab = emb.weight.shape[0]
        padded = padded_size(vocab, ctx.world)
        spec = ShardSpec(dim=0, world=ctx.world, full=vocab, padded=padded if padded != vocab else 0)
        weight = shard_param(emb.weight, spec, ctx, memo)
        return cls(weight, ctx, vocab, emb.padding_idx, scale)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.per_rank)
        local = local.masked_fill(outside, 0)
        pad = None
        if self.padding_idx is not None and 0 <= self.padding_idx - self.vocab_start < self.per_rank:
            pad = self.padding_idx - self.vocab_start
        out = F.embedding(local, self.weight, pad)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        out = comm.reduce_from_tp(out, self.ctx.group)
        if self.embed_scale is None:
            return out
        scale = self.embed_scale
        return out * (scale.to(out.dtype) if isinstance(scale, torch.Tensor) else scale)

    def extra_repr(self):
        return f"{self.per_rank}/{self.num_embeddings}, {self.embedding_dim}, tp={self.ctx.world}"
