"""Context parallelism: each of cp ranks holds two load-balanced chunks of every sequence and attention
runs over the cp group (a ring of K/V, or an all-to-all over heads). See docs/context-parallel.md."""

from .chunks import chunk_ids, cut_batch, global_positions
from .ring import ring_attention
from .ulysses import all_to_all_attention

__all__ = ["chunk_ids", "cut_batch", "global_positions", "ring_attention", "all_to_all_attention"]
