"""Llama 4's mixture of experts (transformers' ``Llama4TextMoe``) expert-parallel: the model's own router (top-k
of the logits, the sigmoid of each chosen one scaling that expert's *input*), its shared expert, and this rank's
share of the experts' 3-D weights ``gate_up_proj [E, H, 2I]``, ``down_proj [E, I, H]``."""

from __future__ import annotations

import torch
from torch import nn

from ...marks import set_marks
from ..dispatch import combine, dispatch
from ..expert_tp import enter, leave
from ..families import LLAMA4
from .fused import expert_slice
from .layer import ExpertParallelMoE, as_block


class ExpertParallelLlama4(ExpertParallelMoE):
    """``block``'s router and shared expert, experts ``[first, first + E/ep)`` of its ``experts`` (sliced in place:
    state-dict names stay the block's), their rows exchanged over ``group`` (``fold_group``: see ExpertParallelMoE)."""

    def __init__(self, block: nn.Module, group, ep: int, ep_rank: int, sp_group=None, fold_group=None):
        nn.Module.__init__(self)
        self.family, self.group, self.sp_group, self.capacity_factor = LLAMA4, group, sp_group, None
        self.fold_group, self.etp_group = fold_group, None
        self.num_experts, self.top_k, self.hidden_dim = block.num_experts, block.top_k, block.hidden_dim
        count = self.num_experts // ep
        self.first = ep_rank * count
        self.router, self.shared_expert, self.experts = block.router, block.shared_expert, block.experts
        self._route = LLAMA4.route(block)
        for name, p in list(self.experts.named_parameters(recurse=False)):
            sliced, spec = expert_slice(p, ep, ep_rank)
            param = nn.Parameter(sliced.clone(), requires_grad=p.requires_grad)
            set_marks(param, expert=ep > 1, tp_spec=spec)
            setattr(self.experts, name, param)
        self.experts.num_experts = count

    def forward(self, hidden_states: torch.Tensor):
        x = hidden_states.reshape(-1, self.hidden_dim)
        scores, logits = self.router(x)
        idx = torch.topk(logits, self.top_k, dim=1).indices  # the router's own choice: the same top-k of the same logits
        scale = scores.gather(1, idx).to(x.dtype)
        pairs = (x.unsqueeze(1) * scale.unsqueeze(-1)).reshape(-1, x.shape[-1])  # a (token, expert) pair a row
        ids, ones = idx.reshape(-1, 1), x.new_ones(idx.numel(), 1)
        mine, ones, ids = enter(pairs, ones, ids, self.fold_group)
        rows, per_expert, handle = dispatch(mine, ids, self.num_experts, self.group)
        y = leave(combine(self._experts(rows, per_expert), ones, handle, self.group), pairs.shape[0], self.fold_group)
        out = self.shared_expert(hidden_states).reshape(x.shape)
        return out + y.view(-1, self.top_k, y.shape[-1]).sum(1), logits

    def _experts(self, rows: torch.Tensor, per_expert: list) -> torch.Tensor:
        """This rank's experts on their runs of ``rows``, as ``Llama4TextExperts`` computes each one."""
        e = self.experts
        outs = []
        for i, chunk in enumerate(rows.split(per_expert)):
            gate, up = (chunk @ e.gate_up_proj[i]).chunk(2, dim=-1)
            outs.append((up * e.act_fn(gate)) @ e.down_proj[i])
        return torch.cat(outs)


def llama4_parallel(block: nn.Module, group, ep: int, ep_rank: int, sp_group=None, fold_group=None):
    """An :class:`ExpertParallelLlama4` that is also an instance of ``block``'s class (found by class as before)."""
    return as_block(ExpertParallelLlama4, block, group, ep, ep_rank, sp_group, fold_group)
