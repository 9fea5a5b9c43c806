"""Switch Transformers' sparse MLP (transformers 4.x and 5.x) expert-parallel: the model's own top-1 router,
whose capacity is counted per whole sequence, decides; the tokens it keeps go to the rank holding their
expert, the dropped ones add nothing (as in the model)."""

from __future__ import annotations

import torch
from torch import nn

from ... import comm
from ..dispatch import combine, dispatch
from ..expert_tp import enter, leave
from .layer import ExpertParallelMoE, as_block
from ..families import SWITCH


class ExpertParallelSwitch(ExpertParallelMoE):
    """``block``'s router and experts ``expert_{first}`` .. of its ``experts`` over ``group``; on sequence shards
    (``sp_group``) the router sees the whole sequence (its capacity counts per sequence) and a shard comes back."""

    def __init__(self, block: nn.Module, group, ep: int, ep_rank: int, sp_group=None, fold_group=None):
        nn.Module.__init__(self)
        self.family, self.group, self.sp_group, self.capacity_factor = SWITCH, group, sp_group, None
        self.fold_group, self.etp_group = fold_group, None
        self.num_experts, self.top_k = block.router.num_experts, 1
        count = self.num_experts // ep
        self.first = ep_rank * count
        self.router = block.router
        self.experts = nn.ModuleDict({f"expert_{i}": block.experts[f"expert_{i}"]
                                      for i in range(self.first, self.first + count)})
        self.returns_router = type(block.experts) is nn.ModuleDict  # transformers 4.x: (hidden, (logits, experts))

    def forward(self, hidden_states: torch.Tensor):
        if self.sp_group is not None:
            hidden_states = comm.gather_to_full_sp(hidden_states, self.sp_group, dim=1)
        mask, probs, logits = self.router(hidden_states)
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        flat = mask.reshape(-1, mask.shape[-1])
        kept = flat.sum(-1).nonzero().squeeze(1)  # tokens within their expert's capacity
        idx = flat[kept].argmax(-1, keepdim=True)
        mine, weights, idx = enter(x[kept], probs.reshape(-1, 1)[kept], idx, self.fold_group)
        rows, per_expert, handle = dispatch(mine, idx, self.num_experts, self.group)
        y = leave(combine(self._experts(rows, per_expert), weights, handle, self.group), kept.shape[0], self.fold_group)
        y = x.new_zeros(x.shape).index_copy(0, kept, y.to(x.dtype)).view(hidden_states.shape)
        if self.sp_group is not None:
            y = comm.scatter_to_sp(y, self.sp_group, dim=1)
        return (y, (logits, mask.argmax(-1))) if self.returns_router else y


def switch_parallel(block: nn.Module, group, ep: int, ep_rank: int, sp_group=None, fold_group=None):
    """An :class:`ExpertParallelSwitch` that is also an instance of ``block``'s class (found by class as before)."""
    return as_block(ExpertParallelSwitch, block, group, ep, ep_rank, sp_group, fold_group)


def on_meta(block: nn.Module, hidden_states: torch.Tensor):
    """What Switch Transformers' sparse MLP returns, in shapes only: its routing cannot run on the meta device
    (a pipeline stage works out the output of a block another stage holds from a meta copy)."""
    if type(block.experts) is not nn.ModuleDict:  # transformers 5.x: the hidden states alone
        return torch.empty_like(hidden_states)
    lead = hidden_states.shape[:-1]
    logits = hidden_states.new_empty(*lead, block.router.num_experts)
    return torch.empty_like(hidden_states), (logits, hidden_states.new_empty(lead, dtype=torch.long))
