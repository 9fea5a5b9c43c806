"""ZeRO: optimizer state sharded over data parallelism (``MegaStrategy(zero=1)``). See docs/zero.md."""

from .optimizer import ShardedOptimizer, shard_optimizers

__all__ = ["ShardedOptimizer", "shard_optimizers"]
