"""Column- and row-parallel linear layers built from the user's own ``nn.Linear``, keeping its
parameter names. See docs/design/tensor-parallel.md."""

from __future__ import annotations

import dataclasses

import weakref

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .. import comm
from .shard import ShardSpec, check_divisible, mark, padded_size, shard
from ..marks import marks_of


@dataclass
class TPContext:
    """What a parallel layer needs to know about its tensor-parallel group."""

    group: object = None
    world: int = 1
    rank: int = 0
    sp: bool = False
    seq_dim: int = 1
    seq_len: int = 0  # the whole sequence's length, as SP last started (see plans.hooks.whole_outputs)
    sp_fallback: bool = True  # without grad, a length tp does not divide runs without SP (not under pp)
    whole: bool = False  # this forward runs without SP (such a length, see plans.hooks.install_sp_boundaries)
    here: object = None  # an encoder-decoder under pp: path -> whether it runs for real now (see tp_in_pp.sp_stages)

    def sp_now(self) -> bool:
        """SP for this call: configured, unless a forward without grad runs whole (a recomputation in a
        backward has grad, and is the forward it recomputes)."""
        return self.sp and not (self.whole and not torch.is_grad_enabled())

    def __deepcopy__(self, memo):
        """Shared by a copy of the model (an EMA, SWA's average): the same group, the same layout."""
        return self

    def enter_region(self, x: torch.Tensor) -> torch.Tensor:
        """Replicated (or SP-sharded) activation -> input of column-parallel work."""
        if self.sp_now():
            return comm.gather_from_sp(x, self.group, self.token_dim(x))
        return comm.copy_to_tp(x, self.group)

    def enter_whole(self, x: torch.Tensor) -> torch.Tensor:
        """An activation whole along the sequence even under SP (an encoder's output, gathered where its
        SP ends) -> input of column-parallel work: a copy, its backward an all-reduce."""
        return comm.copy_to_tp(x, self.group)

    def token_dim(self, x: torch.Tensor) -> int:
        """The dimension SP shards ``x`` along: the sequence's, or dim 0 of tokens flattened to 2-d (OPT's
        MLP runs on ``(batch x sequence, hidden)``; per-token work does not mind the order the gather
        puts a shard's rows in, and the reduce-scatter after it gives each rank its own rows back)."""
        return self.seq_dim if x.dim() > 2 else 0


def is_conv1d(module: nn.Module) -> bool:
    """Hugging Face's Conv1D (GPT-2): a linear layer whose weight is stored as (in, out)."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def shard_param(p: Optional[nn.Parameter], spec: ShardSpec, ctx: TPContext, memo: dict) -> Optional[nn.Parameter]:
    """Cut ``p``; a parameter seen before (tied weights) returns the same sharded Parameter."""
    if p is None:
        return None
    if id(p) in memo:
        new = memo[id(p)]
        if marks_of(new).tp_spec != spec:
            raise ValueError(f"a tied parameter is sharded two different ways ({marks_of(new).tp_spec} vs {spec}); "
                             f"untie it.")
        return new
    new = nn.Parameter(shard(p.detach(), spec, ctx.rank), requires_grad=p.requires_grad)
    new._lightning_tp = dataclasses.replace(marks_of(p), tp_spec=spec, sp_partial=False)  # the stage split's marks kept
    memo[id(p)] = new
    return new


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W split by output rows: this rank computes out_features/tp outputs. ``input_comm``:
    enter the TP region here; ``gather_output``: all-gather the outputs (``"eval"``: outside training
    only). See docs/design/tensor-parallel.md."""

    def __init__(self, weight, bias, ctx: TPContext, full_out: int, input_comm=True, gather_output=False,
                 transposed=False):
        super().__init__()
        self.weight, self.bias, self.ctx, self.transposed = weight, bias, ctx, transposed
        self.out_features, self.in_features = weight.shape[::-1] if transposed else weight.shape
        self.full_out, self.input_comm, self.gather_output = full_out, input_comm, gather_output

    @classmethod
    def from_linear(cls, linear: nn.Module, ctx: TPContext, name: str, memo: dict, *, input_comm=True,
                    gather_output=False, chunks=1, pad=False, sections=(), replicas=()) -> "ColumnParallelLinear":
        """``linear``: an nn.Linear, or a GPT-2 style Conv1D (weight stored as in x out). ``replicas``:
        per piece, how many ranks hold the same slice (key/value heads copied when tp exceeds them)."""
        transposed = is_conv1d(linear)
        out = linear.weight.shape[1 if transposed else 0]
        padded = padded_size(out, ctx.world) if pad else 0
        if not pad:
            for i, size in enumerate(sections or (out // chunks,)):
                slices = ctx.world // (replicas[i if sections else 0] if replicas else 1)
                check_divisible("out_features", name, size, slices,
                                "Choose sizes divisible by tp, or leave this layer out of the plan.")
        padded = padded if padded != out else 0
        split = dict(full=out, chunks=chunks, padded=padded, sections=sections, replicas=replicas)
        spec = ShardSpec(dim=1 if transposed else 0, world=ctx.world, **split)
        weight = shard_param(linear.weight, spec, ctx, memo)
        bias = None
        if linear.bias is not None:
            bias_spec = ShardSpec(dim=0, world=ctx.world, **split)
            bias = shard_param(linear.bias, bias_spec, ctx, memo)
        return cls(weight, bias, ctx, out, input_comm=input_comm, gather_output=gather_output,
                   transposed=transposed)

    @property
    def vocab_start(self) -> int:
        return self.ctx.rank * self.out_features

    def forward(self, x):
        if self.input_comm:
            x = self.ctx.enter_region(x)
        y = self.project(x)
        if self.gather_output is True or (self.gather_output == "eval" and not self.training):
            return self.gather(y)
        if self.gather_output == "eval":  # shards for a vocab-parallel loss; whole where the model returns them
            self._shards = weakref.ref(y)  # (see plans.hooks.whole_logits)
        return y

    def gather(self, y):
        """This rank's output columns -> the whole output (vocab padding dropped); backward: the slice."""
        y = comm.gather_from_tp(y, self.ctx.group, -1)
        return y[..., : self.full_out] if y.shape[-1] != self.full_out else y

    def project(self, x):
        """``x W^T + b`` on this rank's rows: the step QAT layers replace (quantizing both operands)."""
        return F.linear(x, self.weight.t() if self.transposed else self.weight, self.bias)

    def extra_repr(self):
        return f"in={self.in_features}, out={self.out_features}/{self.full_out}, tp={self.ctx.world}"


class RowParallelLinear(nn.Module):
    """y = sum_r x_r W_r^T + b with W split by input columns; the partial sums meet in one all-reduce
    (or a reduce-scatter along the sequence under SP). The bias is added once, after the reduction."""

    def __init__(self, weight, bias, ctx: TPContext, input_is_parallel=True, transposed=False):
        super().__init__()
        self.weight, self.bias, self.ctx, self.transposed = weight, bias, ctx, transposed
        self.out_features, self.in_features = weight.shape[::-1] if transposed else weight.shape
        self.input_is_parallel = input_is_parallel

    @classmethod
    def from_linear(cls, linear: nn.Module, ctx: TPContext, name: str, memo: dict,
                    input_is_parallel: bool = True) -> "RowParallelLinear":
        transposed = is_conv1d(linear)
        full_in = linear.weight.shape[0 if transposed else 1]
        check_divisible("in_features", name, full_in, ctx.world,
                        "Choose sizes divisible by tp, or leave this layer out of the plan.")
        spec = ShardSpec(dim=0 if transposed else 1, world=ctx.world, full=full_in)
        weight = shard_param(linear.weight, spec, ctx, memo)
        bias = None
        if linear.bias is not None:
            bias = memo.get(id(linear.bias)) or nn.Parameter(linear.bias.detach().clone())
            memo[id(linear.bias)] = bias
            mark(bias, sp_partial=ctx.sp)
        return cls(weight, bias, ctx, input_is_parallel=input_is_parallel, transposed=transposed)

    def forward(self, x):
        if not self.input_is_parallel:
            x = comm.scatter_to_tp(x, self.ctx.group, -1)
        y = self.project(x, self.reduce)
        return y + self.bias if self.bias is not None else y

    def reduce(self, y):
        """The partial sums over tp: all-reduce, or reduce-scatter along the sequence under SP."""
        if self.ctx.sp_now():
            return comm.reduce_scatter_to_sp(y, self.ctx.group, self.ctx.token_dim(y))
        return comm.reduce_from_tp(y, self.ctx.group)

    def project(self, x, reduce):
        """``reduce(x_r W_r^T)`` without the bias: the step QAT layers replace (they reduce exact
        integer sums before scaling)."""
        return reduce(F.linear(x, self.weight.t() if self.transposed else self.weight))

    def extra_repr(self):
        return f"in={self.in_features}/{self.in_features * self.ctx.world}, out={self.out_features}, tp={self.ctx.world}"
