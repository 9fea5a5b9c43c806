"""The model's own blocks timed on this machine at each tp's per-rank shapes (forward, then backward), for a
plan to use instead of FLOP rates where it runs on the machine it plans for: on as many local processes as
the plan's GPUs, all at once. See docs/planner.md."""

from __future__ import annotations

import copy
import statistics
import time

import torch
from torch import nn

from ..plans import checks
from ..plans import lookup
from ..plans import swap
from .calibrate import adamw_step_seconds
from .profile import first_blocks


def _materialized(module: nn.Module, path: str, n: int) -> nn.Module:
    """A copy of ``module`` (meta tensors are fine) with its first ``n`` blocks, on the CPU with small random
    weights and zero buffers: the values do not matter, the shapes and the code run do."""
    with first_blocks(module, path, n):
        out = copy.deepcopy(module).to_empty(device="cpu")
    with torch.no_grad():
        for p in out.parameters():
            p.normal_(0.0, 0.02)
        for b in out.buffers():
            b.zero_()
    return out


def _prepared(module, path, n, tp, mode, plan):
    """The copy cut to ``n`` blocks, with tp rank 0's shards of a ``tp`` layout and ``mode``'s recomputation."""
    from ..recompute import full as recompute, selective

    model = _materialized(module, path, n)
    if tp > 1:
        swap.apply(model, checks.resolve(model, tp, False, plan), None, tp, 0, False)
    if mode is True:
        recompute.apply(model, recompute.targets(model, True, None, 0, path))
    elif mode == "selective":
        core = lookup.core_of(model, plan)
        selective.apply(selective.blocks_at(model, selective.places(model, None, 0, path, core)), core)
    return model.train()


def _first_tensor(out) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "logits"):
        return out.logits
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise ValueError(f"plan(timed=True): the model's forward on token ids returned {type(out).__name__}; a tensor, "
                     f"a tuple starting with one, or an output with .logits is needed to time its backward.")


def _fwd_bwd(model, x) -> tuple:
    """(forward s, backward s) of one run."""
    for p in model.parameters():
        p.grad = None
    t0 = time.perf_counter()
    loss = _first_tensor(model(x)).float().mean()
    t1 = time.perf_counter()
    loss.backward()
    return t1 - t0, time.perf_counter() - t1


def time_blocks(module: nn.Module, path: str, seq: int, vocab: int, tps, modes, sizes, threads: int,
                plan="auto", repeat: int = 5, world: int = 1) -> dict:
    """(tp, recompute, microbatch size) -> (one block's forward s, its backward s, the rest's forward s, backward s,
    together), and ("optimizer", tp) -> AdamW's seconds per parameter: medians of runs of the model cut to 2 and 3
    blocks on ``threads``; together: on ``world`` > 1 processes at once (as a run's ranks), tp rank 0's shards each."""
    args = (module, path, seq, vocab, tuple(tps), tuple(modes), tuple(sizes), plan, repeat, threads)
    if world == 1:
        return _time_here(0, 1, *args)
    from .local import on_local_processes

    return on_local_processes(world, _time_here, *args, threads=threads)


def _time_here(rank, world, module, path, seq, vocab, tps, modes, sizes, plan, repeat, threads) -> dict:
    """:func:`time_blocks` on this process, one of ``world`` (in a process group of them all when > 1)."""
    import torch.distributed as dist

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    out = {}
    try:
        for tp in tps:
            for mode in modes:
                models = {n: _prepared(module, path, n, tp, mode, plan) for n in (2, 3)}
                for mbs in sizes:
                    x = torch.randint(0, max(vocab, 1), (mbs, seq))
                    runs = {n: [] for n in (2, 3)}
                    if world > 1:  # all start together
                        dist.barrier()
                    for i in range(repeat + 1):
                        for n in (2, 3):
                            run = _fwd_bwd(models[n], x)
                            if i:  # the first is a warm-up
                                runs[n].append(run)
                    block = [max(statistics.median(b[k] - a[k] for a, b in zip(runs[2], runs[3])), 0.0) for k in (0, 1)]
                    two = [statistics.median(r[k] for r in runs[2]) for k in (0, 1)]
                    out[(tp, mode, mbs)] = (block[0], block[1], max(two[0] - 2 * block[0], 0.0),
                                            max(two[1] - 2 * block[1], 0.0), world > 1)
                if not mode:  # AdamW over the model's own weights (tp rank 0's shards), every process stepping
                    if world > 1:
                        dist.barrier()
                    out[("optimizer", tp)] = adamw_step_seconds(models[3].parameters())
    finally:
        torch.set_num_threads(before)
    return out
