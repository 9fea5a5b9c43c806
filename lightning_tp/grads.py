"""Gradient bookkeeping after backward: sequence-parallel partial sums, data-parallel averaging,
and clipping by the true global norm.

Why here and not in DDP: sharded and replicated parameters live side by side, and each kind is
reduced over a different group (replicated SP parameters over tp, everything over dp).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from . import comm
from .layers.shard import spec_of

BUCKET_BYTES = 25 * 1024 * 1024


def _buckets(grads: list, limit: int = BUCKET_BYTES):
    bucket, size = [], 0
    for g in grads:
        if bucket and (size + g.numel() * g.element_size() > limit or g.dtype != bucket[0].dtype):
            yield bucket
            bucket, size = [], 0
        bucket.append(g)
        size += g.numel() * g.element_size()
    if bucket:
        yield bucket


def _reduce(grads: list, group, scale: float = 1.0) -> None:
    """All-reduce (sum) the grads in flat buckets, launched together and waited on once."""
    if not grads or comm.group_size(group) == 1:
        return
    pending = []
    for bucket in _buckets(grads):
        flat = _flatten_dense_tensors(bucket)
        comm._record("all_reduce", flat, group)
        pending.append((dist.all_reduce(flat, group=group, async_op=True), flat, bucket))
    for work, flat, bucket in pending:
        work.wait()
        if scale != 1.0:
            flat.mul_(scale)
        for g, synced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
            g.copy_(synced)


def sync_gradients(params, mesh) -> None:
    """Tied first/last-stage weights summed over their two stages, SP-partial grads summed over tp,
    then every grad averaged over dp."""
    if mesh.world_size == 1:
        return
    params = [p for p in params if p.grad is not None]
    if mesh.emb_group is not None and mesh.pp_rank in (0, mesh.pp - 1):
        _reduce([p.grad for p in params if getattr(p, "_pp_tied", False)], mesh.emb_group)
    _reduce([p.grad for p in params if getattr(p, "_tp_sp_partial", False)], mesh.tp_group)
    _reduce([p.grad for p in params], mesh.dp_group, scale=1.0 / mesh.dp)


def global_grad_norm(params, mesh, norm_type: float = 2.0) -> torch.Tensor:
    """Norm of the full model's gradient: each shard counted once, tp replicas counted once."""
    params = [p for p in params if p.grad is not None]
    counted = [p.grad.detach() for p in params if (spec_of(p) is not None or mesh.tp_rank == 0)
               and not (getattr(p, "_pp_tied", False) and mesh.pp_rank > 0)]  # a tied copy counts once
    device = params[0].grad.device if params else torch.device("cpu")
    if math.isinf(norm_type):
        local = max((g.abs().max().float() for g in counted), default=torch.zeros((), device=device))
        return comm.all_reduce(local.clone().reshape(()), mesh.mp_group, op=dist.ReduceOp.MAX)
    local = sum((g.float().norm(norm_type) ** norm_type for g in counted), torch.zeros((), device=device))
    return comm.all_reduce(local, mesh.mp_group) ** (1.0 / norm_type)


def clip_grad_norm(params, max_norm: float, mesh, norm_type: float = 2.0) -> torch.Tensor:
    params = [p for p in params if p.grad is not None]
    total = global_grad_norm(params, mesh, norm_type)
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for p in params:
        p.grad.detach().mul_(coef.to(p.grad.dtype))
    return total
