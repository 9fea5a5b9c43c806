"""Tensor and sequence parallelism inside pipeline stages: sharded meta twins, sequence splits."""
