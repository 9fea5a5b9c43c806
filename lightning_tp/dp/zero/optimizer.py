"""The user's optimizer sharded in place over dp (ZeRO-1): its trainable parameters go into flat buckets
and it steps this rank's slices of them; its state dict keeps the unsharded layout, so checkpoints move
between zero=0, zero=1 and any dp size. See docs/zero.md."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ... import comm
from ..grads import chunked, norm_part, replica_buffer_numel
from ...marks import marks_of
from .shards import Bucket, check_optimizer, finish_reduce_scatters


class ShardedOptimizer:
    """What :func:`shard_optimizers` did to one optimizer: its buckets, and each group's parameters as the
    user gave them (the layout of its state dict)."""

    def __init__(self, optimizer, mesh):
        self.optimizer, self.mesh = optimizer, mesh
        self.original = [list(g["params"]) for g in optimizer.param_groups]
        self.buckets = []
        edp = mesh.edp_size  # the ranks holding the same experts
        for g in optimizer.param_groups:
            dense = [p for p in g["params"] if _shardable(p) and not marks_of(p).expert]
            experts = [p for p in g["params"] if _shardable(p) and marks_of(p).expert] if edp > 1 else []
            kept = [p for p in g["params"] if not any(p is q for q in dense + experts)]  # frozen ones: whole
            new = []
            for params, expert in ((dense, False), (experts, True)):
                group, size, rank = (mesh.edp_group, edp, mesh.edp_rank) if expert else \
                    (mesh.dp_group, mesh.replicas, mesh.replica_rank)
                # in the order the backward makes gradients; summed over tp or stages first: buckets of their own
                for early in (True, False):
                    chunk_params = [p for p in reversed(params) if _final_at_backward(p) == early]
                    new += [Bucket(chunk, group, size, rank, mesh.tp_rank, mesh.pp_rank, expert=expert, early=early)
                            for chunk in chunked(chunk_params)]
            self.buckets += new
            g["params"] = kept + [s.param for b in new for s in b.slices]
        self.slice_of = {id(s.param): (b, s) for b in self.buckets for s in b.slices}
        self._state_dict, self._load_state_dict = optimizer.state_dict, optimizer.load_state_dict
        optimizer.state_dict, optimizer.load_state_dict = self.state_dict, self.load_state_dict
        optimizer._lightning_tp_zero = self

    overlapped = False  # a ZeroOverlap reduce-scatters the early buckets (see .overlap)

    def bucketed(self) -> set:
        """ids of the parameters in buckets (their gradients reach the optimizer reduce-scattered)."""
        return {id(p) for b in self.buckets for p in b.params}

    def reduce_scatter(self) -> None:
        """Each bucket's gradients into this rank's slices; a parameter no replica had a gradient for
        gets none (a flag each, sent with the gradients), so the optimizer skips it as zero=0 does."""
        # one bucket's buffer at a time (started as the last is waited for), one host wait for all their flags;
        # an expert's gradient sums its ep group's tokens: 1/dp as well
        buckets = [b for b in self.buckets if not (self.overlapped and b.early)]
        finish_reduce_scatters(buckets, (b.start_reduce_scatter() for b in buckets), 1.0 / self.mesh.replicas)

    def norm_parts(self, norm_type: float, device) -> list:
        """The slices' part of the global gradient norm (norm_type-th power, or max), [dense, experts],
        each over its buckets' group (None where there are no such buckets)."""
        out = []
        for expert in (False, True):
            buckets = [b for b in self.buckets if b.expert == expert]
            if not buckets:
                out.append(None)
                continue
            part = norm_part([s.param.grad.detach() * s.counted for b in buckets for s in b.slices
                              if s.param.grad is not None], norm_type, device)
            op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
            out.append(comm.all_reduce(part, buckets[0].group, op=op))
        return out

    def all_gather(self) -> None:
        """Every bucket's all-gather started at once, then waited on."""
        for work in [b.all_gather(wait=False) for b in self.buckets]:
            work.wait()

    def _index(self) -> dict:
        return {id(p): i for i, p in enumerate(p for ps in self.original for p in ps)}

    def state_dict(self) -> dict:
        """The state dict zero=0 would give (each parameter's whole state), on every rank: collective over dp."""
        sd, index = self._state_dict(), self._index()
        current = [p for g in self.optimizer.param_groups for p in g["params"]]
        state, mine = {}, {}
        for j, p in enumerate(current):
            if j in sd["state"]:
                if id(p) in self.slice_of:
                    mine[id(p)] = sd["state"][j]
                else:
                    state[index[id(p)]] = sd["state"][j]
        meta = {}  # (bucket, parameter) -> {key: its value, or ("sliced", dtype) for a per-element one}
        local = [(bi, s.index, {k: ("sliced", v.dtype) if _per_element(v, s.param) else v
                                for k, v in mine[id(s.param)].items()})
                 for bi, b in enumerate(self.buckets) for s in b.slices if id(s.param) in mine]
        everyone = [None] * comm.group_size(self.mesh.dp_group)
        dist.all_gather_object(everyone, local, group=self.mesh.dp_group)
        for part in everyone:
            for bi, i, entry in part:
                meta.setdefault((bi, i), {}).update(entry)
        for bi, b in enumerate(self.buckets):
            keys = sorted({k for (bj, _), entry in meta.items() if bj == bi for k, v in entry.items() if _marked(v)})
            full = {k: b.gather({id(s.param): mine[id(s.param)][k] for s in b.slices
                                 if k in mine.get(id(s.param), {})}) for k in keys}
            for i, q in enumerate(b.params):
                entry = meta.get((bi, i))
                if entry is None:
                    continue
                at = b.offsets[i]
                state[index[id(q)]] = {k: full[k][at:at + q.numel()].view_as(q).to(v[1]).clone() if _marked(v) else v
                                       for k, v in entry.items()}
        groups = [dict(g, params=[index[id(p)] for p in ps]) for g, ps in zip(sd["param_groups"], self.original)]
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, full: dict) -> None:
        """Take a state dict in zero=0's layout (saved at any dp size), keeping this rank's slices; one a
        checkpoint filled slice by slice (``lightning_tp_zero_slices``) as it is."""
        if full.get("lightning_tp_zero_slices"):
            return self._load_state_dict({k: v for k, v in full.items() if k != "lightning_tp_zero_slices"})
        index, saved, state = self._index(), full["state"], {}
        current = [p for g in self.optimizer.param_groups for p in g["params"]]
        for j, p in enumerate(current):
            if id(p) not in self.slice_of:
                if index[id(p)] in saved:
                    state[j] = saved[index[id(p)]]
                continue
            b, s = self.slice_of[id(p)]
            q = b.params[s.index]
            x = saved.get(index[id(q)])
            if x is not None:
                state[j] = {k: v.reshape(-1)[s.part].clone() if _per_element(v, q) else v for k, v in x.items()}
        groups, start = [], 0
        for saved_group, g in zip(full["param_groups"], self.optimizer.param_groups):
            groups.append(dict(saved_group, params=list(range(start, start + len(g["params"])))))
            start += len(g["params"])
        self._load_state_dict({"state": state, "param_groups": groups})


def shard_optimizers(optimizers, mesh) -> list:
    """Shard each optimizer over ``mesh``'s dp group (see :class:`ShardedOptimizer`), every one checked first."""
    for o in optimizers:
        check_optimizer(o)
    return [ShardedOptimizer(o, mesh) for o in optimizers]


def _final_at_backward(p) -> bool:
    """Whether ``p``'s gradient is final when the backward makes it (not summed over tp or stages after)."""
    m = marks_of(p)
    return not (m.sp_partial or m.pp_tied or m.pp_late_sync or replica_buffer_numel(p))


def _shardable(p) -> bool:
    return p.requires_grad and p.is_floating_point()


def _per_element(value, param) -> bool:
    """A state entry held per element of ``param`` (a moment), not per tensor (a step count)."""
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == param.shape


def _marked(value) -> bool:
    return isinstance(value, tuple) and len(value) == 2 and value[0] == "sliced"
