"""Parallel layers, each built from the user's initialized module (it keeps this rank's shard)."""

from .attention import TPMultiheadAttention
from .cross_entropy import VocabParallelCrossEntropy, vocab_parallel_cross_entropy
from .embedding import VocabParallelEmbedding
from .linear import ColumnParallelLinear, RowParallelLinear, TPContext
from .shard import ShardSpec, shard, unshard

__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "TPContext", "VocabParallelEmbedding", "VocabParallelCrossEntropy",
    "vocab_parallel_cross_entropy", "TPMultiheadAttention", "ShardSpec", "shard", "unshard",
]
