"""The machines a plan is made for: GPUs per node, memory, peak rate and the links inside and across nodes,
and how long a collective of a given size takes over them. See docs/planner.md."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Cluster:
    """``gpus`` devices, ``gpus_per_node`` to a node; rates per GPU (link speeds in Gbit/s, one direction)."""

    gpus: int
    gpus_per_node: int = 8
    gpu_memory_gib: float = 80.0
    peak_tflops: float = 989.0  # dense bf16 matrix rate
    intra_node_gbps: float = 3600.0
    inter_node_gbps: float = 400.0
    hbm_gbps: float = 26800.0  # device memory bandwidth (Gbit/s): 3350 GB/s
    gemm_efficiency: float = 0.85  # the best share of peak a large GEMM reaches
    gemm_half_gflop: float = 4.0  # a GEMM of this many GFLOP runs at half that share
    latency_us: float = 10.0  # per collective step across nodes
    intra_latency_us: float = 2.0  # per collective step inside a node
    ops: tuple = ()  # measured (op, Gbit/s, latency s) inside a node, overriding the link's (see .calibrate)
    step_overhead_s: float = 0.0  # per optimizer step: the training loop's own time (see .calibrate)
    action_overhead_s: float = 0.0  # per pipeline action (a microbatch's forward or backward on a stage)
    compute_slowdown: float = 1.0  # timed compute runs this much slower with every process at work (CPU)
    comm_overlap: float = 1.0  # the share of a dp collective the backward's compute hides (CPU: they share cores)
    optimizer_s_per_param: float = 0.0  # an AdamW step's seconds per parameter, measured (else from bandwidth)

    def __post_init__(self):
        for name in ("gpus", "gpus_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"plan({name}={value!r}): a positive integer.")
        if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            raise ValueError(f"plan(gpus={self.gpus}, gpus_per_node={self.gpus_per_node}): whole nodes only "
                             f"(gpus a multiple of gpus_per_node).")
        for name in ("gpu_memory_gib", "peak_tflops", "intra_node_gbps", "inter_node_gbps", "hbm_gbps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"plan({name}={getattr(self, name)!r}): a positive number.")

    def gemm_seconds(self, flops: float, gemm_gflop: float) -> float:
        """Time for ``flops`` of matrix products whose single GEMMs are ``gemm_gflop`` GFLOP each."""
        share = self.gemm_efficiency * gemm_gflop / (gemm_gflop + self.gemm_half_gflop)
        return flops / (self.peak_tflops * 1e12 * share)

    def memory_seconds(self, nbytes: float) -> float:
        """Time to stream ``nbytes`` through device memory (elementwise kernels, the optimizer)."""
        return nbytes * 8 / (self.hbm_gbps * 1e9)

    def inside(self, span: int, stride: int) -> bool:
        """Whether every group of ``span`` ranks ``stride`` apart (tp fastest) lies in one node: the groups'
        extent divides the node (tp=6 on 8-GPU nodes straddles them), or the cluster is one node."""
        extent = span * stride
        return extent <= self.gpus_per_node and (self.gpus <= self.gpus_per_node or self.gpus_per_node % extent == 0)

    def link(self, span: int, stride: int) -> tuple:
        """(Gbit/s, latency s) of a group of ``span`` ranks ``stride`` apart (tp fastest): inside a node
        when every such group fits in one, else across nodes."""
        inside = self.inside(span, stride)
        return (self.intra_node_gbps, self.intra_latency_us * 1e-6) if inside else (self.inter_node_gbps,
                                                                                      self.latency_us * 1e-6)

    def collective_seconds(self, op: str, nbytes: float, span: int, stride: int = 1) -> float:
        """A ring ``op`` ("all_reduce", "all_gather", "reduce_scatter", "p2p"; "tp_"/"sp_"/"dp_" prefixed: as the
        strategy runs it, where measured) of ``nbytes`` (the whole tensor) over ``span`` ranks ``stride`` apart."""
        if span <= 1 or nbytes <= 0:
            return 0.0
        gbps, latency = self.link(span, stride)
        measured = {name: (g, lat) for name, g, lat in self.ops}
        base = op.split("_", 1)[1] if op.startswith(("tp_", "sp_", "dp_")) else op  # as the strategy runs it
        for name in (op, base):
            if name in measured and self.inside(span, stride):
                gbps, latency = measured[name]
                break
        if op == "p2p":
            return nbytes * 8 / (gbps * 1e9) + latency
        steps = 2 * (span - 1) if base == "all_reduce" else span - 1
        return steps * (nbytes / span) * 8 / (gbps * 1e9) + steps * latency
