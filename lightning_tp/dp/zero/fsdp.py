"""zero=3: parameters, gradients and optimizer state sharded over dp by torch's FSDP2 (``fully_shard``),
each block one unit and the rest of the model the root's. See docs/zero.md."""

from __future__ import annotations

import torch.nn as nn

from ...marks import marks_of


def check_zero3(pp: int, microbatches: int, ep: int, quant) -> None:
    """The layouts zero=3 composes with, checked with the options (the same error on every rank)."""
    if pp > 1 or microbatches > 1:
        raise ValueError(f"MegaStrategy(zero=3) with pp={pp}, microbatches={microbatches}: FSDP2 gathers a block's "
                         f"parameters per forward and reduce-scatters per backward, which the pipeline's per-microbatch "
                         f"passes do not drive yet. Use zero=1 with a pipeline, or pp=1 and microbatches=1.")
    if ep > 1:
        raise ValueError(f"MegaStrategy(zero=3) with ep={ep}: expert weights differ between the ep ranks, so they cannot "
                         f"be sharded over all of dp. Use zero=1 with experts.")
    if quant is not None:
        raise ValueError(f"MegaStrategy(zero=3) with quant={quant!r}: quantization-aware layers keep ranges next to their "
                         f"weights that FSDP2 does not shard; use zero=1.")


def shard_parameters(module: nn.Module, dp_mesh, blocks: list) -> None:
    """``fully_shard`` each block, then the whole module, over ``dp_mesh``; the new parameters keep the old
    ones' marks (tp sharding, sequence-parallel partial gradients)."""
    from torch.distributed.fsdp import fully_shard

    marks = {name: marks_of(p) for name, p in module.named_parameters(remove_duplicate=False)}
    for block in blocks:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(module, mesh=dp_mesh)
    for name, p in module.named_parameters(remove_duplicate=False):
        p._lightning_tp = marks[name]


def sharded_before(module: nn.Module) -> bool:
    """Whether ``module`` was sharded by FSDP2 already (a module a second Trainer fits again)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)
