"""Process groups for tensor (tp), data (dp) and pipeline (pp) parallelism, tp fastest, then dp, then
pp: ``global_rank = pp_rank * (dp * tp) + dp_rank * tp + tp_rank``. See docs/design/strategy.md."""

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


def data_parallel_size(world_size: int, tp: int = 1, pp: int = 1) -> int:
    """dp = world // (tp * pp), with an error that says what to set when it does not divide."""
    tp, pp = _positive_int("tp", tp), _positive_int("pp", pp)
    if world_size % (tp * pp) != 0:
        raise ValueError(
            f"MegaStrategy(tp={tp}, pp={pp}) needs a world size divisible by tp*pp={tp * pp}, but the run has "
            f"{world_size} processes (devices x num_nodes). Set devices/num_nodes to a multiple of {tp * pp} "
            f"or change tp/pp."
        )
    return world_size // (tp * pp)


@dataclass
class ParallelMesh:
    """Sizes, this rank's coordinates and the process groups of one run (``None`` groups when
    torch.distributed is not initialized). See docs/design/strategy.md."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    rank: int = 0
    tp_group: Optional[dist.ProcessGroup] = None
    dp_group: Optional[dist.ProcessGroup] = None
    pp_group: Optional[dist.ProcessGroup] = None
    mp_group: Optional[dist.ProcessGroup] = None  # tp x pp: one full copy of the model
    emb_group: Optional[dist.ProcessGroup] = None  # first + last stage: tied input/output embeddings
    emb_ranks: tuple = ()  # the pp ranks of emb_group when not (0, pp - 1) (see use_tied_ranks)
    ep: int = 1  # expert parallel: the dp ranks ep_rank = dp_rank % ep split each layer's experts
    ep_group: Optional[dist.ProcessGroup] = None
    edp_group: Optional[dist.ProcessGroup] = None  # the dp ranks holding the same experts (dp / ep of them)
    device_mesh: object = field(default=None, repr=False)
    timeout: Optional[timedelta] = None  # MegaStrategy(timeout=): every group made here honours it

    def new_group(self, ranks=None, backend=None):
        """``dist.new_group`` with this run's timeout (collective: every rank calls it)."""
        return dist.new_group(ranks, timeout=self.timeout, backend=backend)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def dp_rank(self) -> int:
        return (self.rank // self.tp) % self.dp

    @property
    def pp_rank(self) -> int:
        return self.rank // (self.tp * self.dp)

    @property
    def ep_rank(self) -> int:
        return self.dp_rank % self.ep

    @property
    def edp_rank(self) -> int:
        return self.dp_rank // self.ep

    def global_rank(self, tp_rank: int = 0, dp_rank: int = 0, pp_rank: int = 0) -> int:
        return pp_rank * self.dp * self.tp + dp_rank * self.tp + tp_rank


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
    return {name: (backend, options) for name in ("pp", "dp", "tp")}


def build_mesh(tp: int = 1, pp: int = 1, device_type: str = "cpu", ep: int = 1,
               timeout: Optional[timedelta] = None) -> ParallelMesh:
    """Create the groups, each with ``timeout``. Every rank must call this with the same arguments
    (new_group is collective)."""
    if not (dist.is_available() and dist.is_initialized()):
        data_parallel_size(1, tp, pp)
        return ParallelMesh()
    world, rank = dist.get_world_size(), dist.get_rank()
    dp = data_parallel_size(world, tp, pp)
    from torch.distributed.device_mesh import init_device_mesh

    override = _timeout_options(timeout)
    device_mesh = init_device_mesh(device_type, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"),
                                   **({"backend_override": override} if override else {}))
    mesh = ParallelMesh(tp=tp, pp=pp, dp=dp, rank=rank, device_mesh=device_mesh, ep=ep, timeout=timeout)
    mesh.tp_group = device_mesh.get_group("tp")
    mesh.dp_group = device_mesh.get_group("dp")
    mesh.pp_group = device_mesh.get_group("pp")
    # Model-parallel group (tp x pp for one dp index): not a contiguous mesh slice, so built by hand.
    for d in range(dp):
        ranks = [mesh.global_rank(t, d, p) for p in range(pp) for t in range(tp)]
        group = mesh.new_group(ranks)
        if d == mesh.dp_rank:
            mesh.mp_group = group
    if pp > 1:
        for d in range(dp):
            for t in range(tp):
                group = mesh.new_group([mesh.global_rank(t, d, 0), mesh.global_rank(t, d, pp - 1)])
                if (t, d) == (mesh.tp_rank, mesh.dp_rank):
                    mesh.emb_group = group
    if ep > 1:
        _expert_groups(mesh)
    return mesh


def _expert_groups(mesh: ParallelMesh) -> None:
    """ep groups (consecutive dp ranks: dp_rank // ep alike) and expert-data-parallel groups (dp_rank % ep
    alike), per tp and pp rank. Every rank creates every group in the same order (new_group is collective)."""
    ep, edp = mesh.ep, mesh.dp // mesh.ep
    for p in range(mesh.pp):
        for t in range(mesh.tp):
            here = (t, p) == (mesh.tp_rank, mesh.pp_rank)
            for j in range(edp):
                group = mesh.new_group([mesh.global_rank(t, j * ep + e, p) for e in range(ep)])
                if here and j == mesh.edp_rank:
                    mesh.ep_group = group
            for e in range(ep):
                group = mesh.new_group([mesh.global_rank(t, j * ep + e, p) for j in range(edp)])
                if here and e == mesh.ep_rank:
                    mesh.edp_group = group


def gloo_twin_of_mp_group(mesh: ParallelMesh):
    """This rank's model-parallel group again, on gloo: small CPU-side messages (a batch's layout) that
    must not wait for the GPU. Every rank must call this (new_group is collective)."""
    mine = None
    for d in range(mesh.dp):
        group = mesh.new_group([mesh.global_rank(t, d, p) for p in range(mesh.pp) for t in range(mesh.tp)],
                               backend="gloo")
        if d == mesh.dp_rank:
            mine = group
    return mine


def use_tied_ranks(mesh: ParallelMesh, pp_ranks: tuple) -> None:
    """Point ``emb_group`` at other pp ranks (an encoder-decoder's embedding copies: the first stage and
    the decoder's first). Every rank must call this with the same ranks (new_group is collective)."""
    if tuple(pp_ranks) == (mesh.emb_ranks or (0, mesh.pp - 1)) or not (dist.is_available() and dist.is_initialized()):
        return
    mesh.emb_group, mesh.emb_ranks = None, tuple(pp_ranks)
    for d in range(mesh.dp):
        for t in range(mesh.tp):
            group = mesh.new_group([mesh.global_rank(t, d, p) for p in pp_ranks])
            if (t, d) == (mesh.tp_rank, mesh.dp_rank):
                mesh.emb_group = group
