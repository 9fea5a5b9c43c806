"""Gradient bookkeeping after backward: sequence-parallel partial sums, key/value heads copied to
several tp ranks, data-parallel averaging, and clipping by the true global norm.
See docs/design/grads-and-dp.md."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .. import comm
from ..layers.shard import spec_of
from ..marks import marks_of
from .zero.local_shards import is_sharded, local

BUCKET_BYTES = 25 * 1024 * 1024


def chunked(grads: list, limit: int = BUCKET_BYTES):
    """Consecutive runs of ``grads`` (tensors) of one dtype and at most ``limit`` bytes (one may exceed it alone)."""
    bucket, size = [], 0
    for g in grads:
        if bucket and (size + g.numel() * g.element_size() > limit or g.dtype != bucket[0].dtype):
            yield bucket
            bucket, size = [], 0
        bucket.append(g)
        size += g.numel() * g.element_size()
    if bucket:
        yield bucket


def start_all_reduce(grads: list, group) -> tuple:
    """One flat bucket's all-reduce (sum), in the background: ``(work, flat, grads)`` for :func:`settle`."""
    flat = _flatten_dense_tensors(grads)
    comm.record("all_reduce", flat, group)
    return dist.all_reduce(flat, group=group, async_op=True), flat, grads


def settle(pending: list, scale: float = 1.0) -> None:
    """Wait for started all-reduces and write the (scaled) sums back into the grads."""
    for work, flat, grads in pending:
        work.wait()
        if scale != 1.0:
            flat.mul_(scale)
        for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(synced)


def _reduce(grads: list, group, scale: float = 1.0) -> None:
    """All-reduce (sum) the grads in flat buckets, launched together and waited on once."""
    if not grads or comm.group_size(group) == 1:
        return
    settle([start_all_reduce(bucket, group) for bucket in chunked(grads)], scale)


def _sum_tied(params, group) -> None:
    """Sum the copies of tied weights over ``group``, every copy in the unsplit model's order; a missing
    gradient counts as zero, and stays missing where no copy had one. See docs/design/grads-and-dp.md."""
    tied = sorted((p for p in params if marks_of(p).pp_tied and p.requires_grad),
                  key=lambda p: marks_of(p).pp_tied_index)
    if not tied:
        return
    had = torch.tensor([float(p.grad is not None) for p in tied], device=tied[0].device)
    for p in tied:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    _reduce([p.grad for p in tied], group)
    if marks_of(tied[0]).pp_copy:  # an encoder-decoder's copies (a tied head is always used)
        dist.all_reduce(had, group=group)
        for p, n in zip(tied, had.tolist()):
            if n == 0:
                p.grad = None


def sync_gradients(params, mesh, dp_overlap=None, repeated: bool = False, zero=()) -> None:
    """Sum tied weights over their stages and SP-partial grads over tp, then average every grad over dp
    (finishing ``dp_overlap`` first; ``zero``'s sharded optimizers: reduce-scattered into their slices).
    ``repeated``: this optimizer step may sync more than once. See docs/design/grads-and-dp.md."""
    if mesh.world_size == 1:
        return
    if dp_overlap is not None:
        dp_overlap.finish()
    params = list(params)
    if mesh.emb_group is not None and mesh.pp_rank in (mesh.emb_ranks or (0, mesh.pp - 1)):
        _sum_tied(params, mesh.emb_group)
    trainable = [p for p in params if p.requires_grad]
    params = [p for p in trainable if p.grad is not None]
    summed = [p for p in params if marks_of(p).sp_partial or _replicated_pieces(p, 0)] \
        if repeated else []  # (found only where a step syncs more than once: manual optimization)
    before = _summed_before(summed)
    _reduce([local(p.grad) for p in params if marks_of(p).sp_partial and not marks_of(p).expert], mesh.tp_group)
    # (zero=3: shards alike) an expert's bias, added on the first of its etp ranks: summed over them alone
    biases = [local(p.grad) for p in params if marks_of(p).sp_partial and marks_of(p).expert]
    _reduce(biases, mesh.etp_group if mesh.etp_group is not None else mesh.tp_group)
    _sum_replicas(params, mesh)
    if repeated:
        _remember_summed(summed, before)
    # without an overlap every grad; with one, those of parameters it does not know (made trainable
    # after setup, e.g. by a fine-tuning callback)
    bucketed = set().union(*(z.bucketed() for z in zero))
    left = [p for p in trainable if (dp_overlap is None or id(p) not in dp_overlap.bucket_of) and id(p) not in bucketed
            and not is_sharded(p)]  # zero=3: FSDP2 reduce-scattered them in the backward
    for z in zero:
        z.reduce_scatter()
    average_over_dp([p for p in left if not marks_of(p).expert], mesh.dp_group, 1.0 / mesh.replicas)
    # an expert's gradient already sums its ep group's tokens: summed over the ranks holding it, over dp
    experts = [p for p in left if marks_of(p).expert]
    if experts:
        average_over_dp(experts, mesh.edp_group, 1.0 / mesh.replicas, always=True)


def _summed_before(params) -> list:
    """Take out of each grad the part a sum over tp in this optimizer step already covered."""
    before = []
    for p in params:
        held = p.__dict__.get("_lightning_tp_summed")
        part = held[1] if held is not None and held[0] is p.grad else None
        if part is not None:
            p.grad.sub_(part)
        before.append(part)
    return before


def _remember_summed(params, before) -> None:
    for p, part in zip(params, before):
        if part is not None:
            p.grad.add_(part)
        p._lightning_tp_summed = (p.grad, p.grad.detach().clone())


def forget_sums(params) -> None:
    """After an optimizer step: the next sync sums whole gradients again."""
    for p in params:
        p.__dict__.pop("_lightning_tp_summed", None)


def with_flags(params: list) -> list:
    """A dp bucket's tensors: every trainable parameter's gradient on every replica, zeros where its
    replica's batch did not reach it (a data-dependent branch, an expert no token chose), so the
    replicas' buckets match; then one flag each, 1 where it had a gradient (see :func:`adopt`)."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flags = torch.ones(len(params), dtype=grads[0].dtype, device=grads[0].device)  # no host sync (GPU)
    for i, p in enumerate(params):
        if p.grad is None:
            flags[i] = 0
    return grads + [flags]


def adopt(params: list, synced: list) -> None:
    """After the all-reduce: a parameter without a gradient here takes the replicas' average where another
    had one, and stays without one where none had. See docs/design/grads-and-dp.md."""
    if all(p.grad is not None for p in params):
        return
    for p, g, flag in zip(params, synced, synced[-1].tolist()):
        if p.grad is None and flag > 0:
            p.grad = g


def average_over_dp(params: list, group, scale: float, always: bool = False) -> None:
    """Sum the parameters' gradients over ``group`` times ``scale`` in flat buckets, missing ones as zeros
    (see with_flags); ``params``: the trainable ones, one set on every replica. ``always``: scale alone too."""
    if not params or (comm.group_size(group) == 1 and not always):
        return
    if comm.group_size(group) == 1:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(scale)
        return
    buckets = [(bucket, with_flags(bucket)) for bucket in chunked(params)]
    settle([start_all_reduce(tensors, group) for _, tensors in buckets], scale)
    for bucket, tensors in buckets:
        adopt(bucket, tensors)


def _replicated_pieces(p, tp_rank: int):
    """(local grad piece, number of slices, this rank's slot) for each replicated piece of ``p``."""
    spec = spec_of(p)
    if spec is None or not spec.replicas:
        return []
    return [(g, spec.slices(i), tp_rank // spec.replica(i), spec.dim)
            for i, g in enumerate(spec.pieces(p.grad, local=True)) if spec.replica(i) > 1]


def replica_buffer_numel(p) -> int:
    """Elements all-reduced over tp for ``p``'s replicated pieces (0 for most parameters)."""
    spec = spec_of(p)
    if spec is None or not spec.replicas:
        return 0
    sizes = spec.sections or [spec.full // spec.chunks] * spec.chunks
    rows = sum(s for i, s in enumerate(sizes) if spec.replica(i) > 1)
    return rows * p.numel() // p.shape[spec.dim]


def _sum_replicas(params, mesh) -> None:
    """A key/value head copied to several tp ranks gets the sum of their gradients. Each rank puts its
    piece in its head's slot of a zero buffer holding every head; one all-reduce over tp fills each
    slot with the sum over the ranks that hold that head. No subgroups needed, at n_kv x the bytes."""
    slots, buffers = [], []
    for p in params:
        for g, n, slot, dim in _replicated_pieces(p, mesh.tp_rank):
            shape = list(g.shape)
            shape[dim] *= n
            buf = g.new_zeros(shape)
            mine = buf.narrow(dim, slot * g.shape[dim], g.shape[dim])
            mine.copy_(g)
            slots.append((g, mine))
            buffers.append(buf)
    _reduce(buffers, mesh.tp_group)
    for g, mine in slots:
        g.copy_(mine)


def agree_on_overflow(scaler, group=None) -> None:
    """fp16 AMP: every rank takes or skips the optimizer step together (GradScaler's found-inf flag is MAX
    all-reduced over ``group`` once per step). See docs/design/grads-and-dp.md."""
    if getattr(scaler, "_lightning_tp_agrees", False):
        return
    unscale, check = scaler.unscale_, scaler._check_inf_per_device

    def unscale_(optimizer):
        unscale(optimizer)
        _agree(scaler, scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"], group)

    def _check_inf_per_device(optimizer):  # the path of optimizers that unscale themselves (fused Adam)
        found = check(optimizer)
        _agree(scaler, found, group)
        return found

    scaler.unscale_, scaler._check_inf_per_device = unscale_, _check_inf_per_device
    scaler._lightning_tp_agrees = True


def _agree(scaler, found: dict, group) -> None:
    """MAX all-reduce of a GradScaler's per-device found-inf flags, written back in place."""
    device = scaler._scale.device if scaler._scale is not None else torch.device("cpu")
    flag = torch.zeros((), dtype=torch.float32, device=device)
    for value in found.values():
        flag = torch.maximum(flag, value.to(device))
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    for key in list(found):
        found[key] = flag.to(found[key].device)
    if not found:  # no gradients here: the flag still decides whether this rank's step runs
        found[device] = flag


def global_grad_norm(params, mesh, norm_type: float = 2.0, zero=None, device=None) -> torch.Tensor:
    """Norm of the full model's gradient: each shard counted once, tp replicas counted once; ``zero``'s
    slices (a ShardedOptimizer, see .zero) counted as it says. ``device``: where the collectives run."""
    params = [p for p in params if p.grad is not None]
    if device is None:  # a rank without gradients still all-reduces: on the backend's device, not the CPU
        device = params[0].grad.device if params else torch.device("cpu")
    sliced = zero.norm_parts(norm_type, device) if zero is not None else (None, None)
    params = [p for p in params if not hasattr(p, "_lightning_tp_zero")]
    parts = []
    for experts in (False, True):  # an ep group's ranks hold different experts: each counted once
        parts.append(norm_part([g.detach() for p in params if marks_of(p).expert == experts
                                for g in counted(p, local(p.grad), mesh.tp_rank, mesh.pp_rank, mesh.etp)], norm_type,
                               device))
    for i, part in enumerate(sliced):
        if part is not None:
            parts[i] = torch.maximum(parts[i], part) if math.isinf(norm_type) else parts[i] + part
    mine, experts = parts
    group = dist.group.WORLD if any(is_sharded(p) for p in params) else mesh.mp_group  # zero=3: dp ranks hold parts too
    if math.isinf(norm_type):
        if mesh.ep > 1:
            experts = comm.all_reduce(experts.clone(), mesh.ep_group, op=dist.ReduceOp.MAX)
        return comm.all_reduce(torch.maximum(mine, experts).clone(), group, op=dist.ReduceOp.MAX)
    if mesh.ep > 1:  # an ep group holds each of its stage's experts once (at one etp slice): counted on the first
        experts = comm.all_reduce(experts, mesh.ep_group) * float(mesh.tp_rank < mesh.etp)  # ep group of each slice
    return comm.all_reduce(mine + experts, group) ** (1.0 / norm_type)


def norm_part(tensors: list, norm_type: float, device) -> torch.Tensor:
    """This rank's part of a norm over ``tensors``: the sum of norm_type-th powers, or the max (inf)."""
    if math.isinf(norm_type):  # one reduction on the device, no host sync per tensor
        return torch.stack([t.abs().max().float() for t in tensors]).max().reshape(()) if tensors else \
            torch.zeros((), device=device)
    return sum((t.float().norm(norm_type) ** norm_type for t in tensors), torch.zeros((), device=device))


def counted(p, t: torch.Tensor, tp_rank: int, pp_rank: int, etp: int = 1) -> list:
    """The parts of ``t`` (shaped like ``p``: its grad) this rank counts in the norm: a tp replica only on its
    first holder, a weight tied over stages only on the first stage."""
    if marks_of(p).pp_tied and pp_rank > 0:
        return []
    if marks_of(p).expert:  # one of this rank's experts (the ep group's ranks, tp ones too, hold others); under
        # etp its slice, or a down projection's bias (whole on each etp rank, summed over them) on the first
        return [t] if not marks_of(p).sp_partial or tp_rank % etp == 0 else []
    spec = spec_of(p)
    if spec is None:  # replicated over tp
        return [t] if tp_rank == 0 else []
    if not spec.replicas:
        return [t]
    return [g for i, g in enumerate(spec.pieces(t, local=True)) if tp_rank % spec.replica(i) == 0]


def clip_grad_norm(params, max_norm: float, mesh, norm_type: float = 2.0, zero=None, device=None) -> torch.Tensor:
    params = [p for p in params if p.grad is not None]
    total = global_grad_norm(params, mesh, norm_type, zero, device)
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for p in params:
        local(p.grad).detach().mul_(coef.to(p.grad.dtype))
    return total
