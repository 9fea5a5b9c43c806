"""Process groups for tensor (tp), context (cp), data (dp) and pipeline (pp) parallelism, tp fastest, then
cp, dp, pp: ``global_rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank``. See
docs/design/strategy.md and docs/context-parallel.md."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Optional

import torch.distributed as dist


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"MegaStrategy({name}={value!r}): {name} must be a positive integer.")
    return value


def data_parallel_size(world_size: int, tp: int = 1, pp: int = 1, cp: int = 1) -> int:
    """dp = world // (tp * cp * pp), with an error that says what to set when it does not divide."""
    tp, pp, cp = _positive_int("tp", tp), _positive_int("pp", pp), _positive_int("cp", cp)
    if world_size % (tp * pp * cp) != 0:
        names = "tp*pp" if cp == 1 else "tp*cp*pp"
        raise ValueError(
            f"MegaStrategy(tp={tp}, pp={pp}{'' if cp == 1 else f', cp={cp}'}) needs a world size divisible by "
            f"{names}={tp * pp * cp}, but the run has {world_size} processes (devices x num_nodes). Set "
            f"devices/num_nodes to a multiple of {tp * pp * cp} or change {names.replace('*', '/')}."
        )
    return world_size // (tp * pp * cp)


@dataclass
class ParallelMesh:
    """Sizes, this rank's coordinates and the process groups of one run (``None`` groups when
    torch.distributed is not initialized). See docs/design/strategy.md."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    rank: int = 0
    cp: int = 1  # context parallel: the ranks that each hold two chunks of every sequence
    tp_group: Optional[dist.ProcessGroup] = None
    dp_group: Optional[dist.ProcessGroup] = None  # the parameters' replicas: dp x cp ranks (dp when cp = 1)
    cp_group: Optional[dist.ProcessGroup] = None
    replica_group: Optional[dist.ProcessGroup] = None  # tp x cp x pp: the ranks that train on one batch
    pp_group: Optional[dist.ProcessGroup] = None
    mp_group: Optional[dist.ProcessGroup] = None  # tp x pp: one full copy of the model (per cp rank)
    emb_group: Optional[dist.ProcessGroup] = None  # first + last stage: tied input/output embeddings
    emb_ranks: tuple = ()  # the pp ranks of emb_group when not (0, pp - 1) (see use_tied_ranks)
    ep: int = 1  # expert parallel: ep ranks of a stage split each layer's experts (see _expert_groups)
    etp: int = 1  # expert tensor parallel: each expert's MLP split over etp consecutive tp ranks (etp divides tp)
    ep_group: Optional[dist.ProcessGroup] = None
    etp_group: Optional[dist.ProcessGroup] = None  # the etp consecutive tp ranks splitting each expert (etp > 1)
    fold_group: Optional[dist.ProcessGroup] = None  # the tp ranks etp apart: each dispatches a share of the tokens
    edp_group: Optional[dist.ProcessGroup] = None  # the ranks of a stage holding the same experts
    device_mesh: object = field(default=None, repr=False)
    timeout: Optional[timedelta] = None  # MegaStrategy(timeout=): every group made here honours it

    def new_group(self, ranks=None, backend=None):
        """``dist.new_group`` with this run's timeout (collective: every rank calls it)."""
        return dist.new_group(ranks, timeout=self.timeout, backend=backend)

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def cp_rank(self) -> int:
        return (self.rank // self.tp) % self.cp

    @property
    def dp_rank(self) -> int:
        return (self.rank // (self.tp * self.cp)) % self.dp

    @property
    def pp_rank(self) -> int:
        return self.rank // (self.tp * self.cp * self.dp)

    @property
    def replicas(self) -> int:
        """Ranks holding the same parameters, whose gradients are averaged: dp x cp."""
        return self.dp * self.cp

    @property
    def replica_rank(self) -> int:
        return self.dp_rank * self.cp + self.cp_rank

    @property
    def stage_rank(self) -> int:
        """This rank among its stage's tp x cp x dp ranks (tp fastest): the experts' grid."""
        return self.rank % (self.tp * self.cp * self.dp)

    @property
    def ep_rank(self) -> int:
        return self.stage_rank // self.etp % self.ep

    @property
    def edp_size(self) -> int:
        """Ranks holding the same experts (edp_group): a stage's tp x cp x dp ranks / (etp x ep)."""
        return self.tp * self.cp * self.dp // (self.ep * self.etp)

    @property
    def edp_rank(self) -> int:
        """This rank's place in its expert-data-parallel group (edp_group: the same experts, other tokens)."""
        return self.stage_rank // (self.etp * self.ep)

    @property
    def ep_group_index(self) -> int:
        """Which of the stage's ep groups this rank is in (one per edp index and, under etp, tp rank)."""
        return self.edp_rank * self.etp + self.stage_rank % self.etp

    @property
    def ep_folds_tp(self) -> bool:
        """Whether an ep group spans tp ranks (experts beyond dp, Megatron's MoE parallel folding)."""
        return self.ep > 1 and self.tp > self.etp

    def global_rank(self, tp_rank: int = 0, dp_rank: int = 0, pp_rank: int = 0, cp_rank: int = 0) -> int:
        return ((pp_rank * self.dp + dp_rank) * self.cp + cp_rank) * self.tp + tp_rank


def _timeout_options(timeout: Optional[timedelta]) -> Optional[dict]:
    """``init_device_mesh``'s backend options carrying ``timeout`` for each dim (None: torch's defaults)."""
    from torch.distributed.device_mesh import init_device_mesh

    backend = dist.get_backend()
    if timeout is None or "backend_override" not in inspect.signature(init_device_mesh).parameters:
        return None
    if backend == "nccl" and hasattr(dist, "ProcessGroupNCCL"):
        options = dist.ProcessGroupNCCL.Options()
    elif backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
    else:
        return None
    options._timeout = timeout
    return {name: (backend, options) for name in ("pp", "dp", "cp", "tp")}


def build_mesh(tp: int = 1, pp: int = 1, device_type: str = "cpu", ep: int = 1,
               timeout: Optional[timedelta] = None, cp: int = 1, etp: int = 1) -> ParallelMesh:
    """Create the groups, each with ``timeout``. Every rank must call this with the same arguments
    (new_group is collective)."""
    if not (dist.is_available() and dist.is_initialized()):
        data_parallel_size(1, tp, pp, cp)
        return ParallelMesh()
    world, rank = dist.get_world_size(), dist.get_rank()
    dp = data_parallel_size(world, tp, pp, cp)
    from torch.distributed.device_mesh import init_device_mesh

    override = _timeout_options(timeout)
    shape, names = ((pp, dp, tp), ("pp", "dp", "tp")) if cp == 1 else ((pp, dp, cp, tp), ("pp", "dp", "cp", "tp"))
    if override:
        override = {name: override[name] for name in names}
    device_mesh = init_device_mesh(device_type, shape, mesh_dim_names=names,
                                   **({"backend_override": override} if override else {}))
    mesh = ParallelMesh(tp=tp, pp=pp, dp=dp, cp=cp, rank=rank, device_mesh=device_mesh, ep=ep, etp=etp,
                        timeout=timeout)
    mesh.tp_group = device_mesh.get_group("tp")
    mesh.pp_group = device_mesh.get_group("pp")
    if cp == 1:
        mesh.dp_group = device_mesh.get_group("dp")
    else:  # the parameters' replicas: dp x cp, by hand (their gradients are averaged in one collective)
        mesh.cp_group = device_mesh.get_group("cp")
        for p in range(pp):
            for t in range(tp):
                group = mesh.new_group([mesh.global_rank(t, d, p, c) for d in range(dp) for c in range(cp)])
                if (t, p) == (mesh.tp_rank, mesh.pp_rank):
                    mesh.dp_group = group
    # Model-parallel group (tp x pp for one dp and cp index): not a contiguous mesh slice, so built by hand.
    for d in range(dp):
        for c in range(cp):
            group = mesh.new_group([mesh.global_rank(t, d, p, c) for p in range(pp) for t in range(tp)])
            if (d, c) == (mesh.dp_rank, mesh.cp_rank):
                mesh.mp_group = group
    mesh.replica_group = mesh.mp_group if cp == 1 else _replica_group(mesh)
    if pp > 1:
        for d in range(dp):
            for c in range(cp):
                for t in range(tp):
                    group = mesh.new_group([mesh.global_rank(t, d, 0, c), mesh.global_rank(t, d, pp - 1, c)])
                    if (t, d, c) == (mesh.tp_rank, mesh.dp_rank, mesh.cp_rank):
                        mesh.emb_group = group
    if ep > 1:  # (at ep=1 an expert split over tp (etp) syncs over dp, as every tp-split weight)
        _expert_groups(mesh)
    if etp > 1 or ep > 1:
        _tp_subgroups(mesh)
    return mesh


def _tp_subgroups(mesh: ParallelMesh) -> None:
    """Each tp group cut two ways for the experts: etp consecutive ranks (``etp_group``) and the ranks etp apart
    (``fold_group``); a cut of the whole tp group reuses it. Every rank creates every group in order."""
    tp, etp = mesh.tp, mesh.etp
    mesh.etp_group = mesh.tp_group if etp == tp else None
    mesh.fold_group = mesh.tp_group if etp == 1 else None
    if etp in (1, tp):
        return
    for p in range(mesh.pp):
        for d in range(mesh.dp):
            for c in range(mesh.cp):
                ranks = [mesh.global_rank(t, d, p, c) for t in range(tp)]
                here = (p, d, c) == (mesh.pp_rank, mesh.dp_rank, mesh.cp_rank)
                for k in range(tp // etp):
                    group = mesh.new_group(ranks[k * etp:(k + 1) * etp])
                    if here and mesh.tp_rank // etp == k:
                        mesh.etp_group = group
                for k in range(etp):
                    group = mesh.new_group(ranks[k::etp])
                    if here and mesh.tp_rank % etp == k:
                        mesh.fold_group = group


def _replica_group(mesh: ParallelMesh, backend=None):
    """The tp x cp x pp ranks of this rank's data replica (they train on one batch). Collective."""
    mine = None
    for d in range(mesh.dp):
        group = mesh.new_group([mesh.global_rank(t, d, p, c) for p in range(mesh.pp) for c in range(mesh.cp)
                                for t in range(mesh.tp)], backend=backend)
        if d == mesh.dp_rank:
            mine = group
    return mine


def _expert_groups(mesh: ParallelMesh) -> None:
    """The experts' grid of each stage, apart from tp, cp and dp (Megatron's MoE parallel folding): its
    tp x cp x dp ranks in order (tp fastest) as etp x ep x edp, etp fastest; ep groups: ep ranks etp apart;
    expert-data-parallel groups (the same experts, other tokens). Every rank creates every group in order."""
    ep, etp, size = mesh.ep, mesh.etp, mesh.tp * mesh.cp * mesh.dp
    edp = size // (ep * etp)
    for p in range(mesh.pp):
        ranks = [p * size + s for s in range(size)]
        here = mesh.pp_rank == p
        for d in range(edp):
            for t in range(etp):
                group = mesh.new_group([ranks[t + etp * (e + ep * d)] for e in range(ep)])
                if here and d * etp + t == mesh.ep_group_index:
                    mesh.ep_group = group
        for e in range(ep):
            for t in range(etp):
                group = mesh.new_group([ranks[t + etp * (e + ep * d)] for d in range(edp)])
                if here and (e, t) == (mesh.ep_rank, mesh.stage_rank % etp):
                    mesh.edp_group = group


def gloo_twin_of_replica_group(mesh: ParallelMesh):
    """This rank's replica group again, on gloo: small CPU-side messages (a batch's layout) that must not
    wait for the GPU. Every rank must call this (new_group is collective)."""
    return _replica_group(mesh, backend="gloo")


def use_tied_ranks(mesh: ParallelMesh, pp_ranks: tuple) -> None:
    """Point ``emb_group`` at other pp ranks (an encoder-decoder's embedding copies: the first stage and
    the decoder's first). Every rank must call this with the same ranks (new_group is collective)."""
    if tuple(pp_ranks) == (mesh.emb_ranks or (0, mesh.pp - 1)) or not (dist.is_available() and dist.is_initialized()):
        return
    mesh.emb_group, mesh.emb_ranks = None, tuple(pp_ranks)
    for d in range(mesh.dp):
        for c in range(mesh.cp):
            for t in range(mesh.tp):
                group = mesh.new_group([mesh.global_rank(t, d, p, c) for p in pp_ranks])
                if (t, d, c) == (mesh.tp_rank, mesh.dp_rank, mesh.cp_rank):
                    mesh.emb_group = group
