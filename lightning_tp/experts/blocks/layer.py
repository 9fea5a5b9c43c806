"""An expert-parallel replacement for a mixture-of-experts block: the same router, this rank's share of
the experts, tokens exchanged with the ranks holding the others (see :mod:`.dispatch`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ... import comm
from ..dispatch import capacity_of, combine, dispatch
from ..expert_tp import bias_on_first, down_biases, enter, leave
from ..families import MoEFamily, check_block
from .fused import both
from .grouped import grouped_forward, runs_grouped


class ExpertParallelMoE(nn.Module):
    """``block``'s router (``gate``) and experts ``[first, first + count)`` of ``experts`` (keys kept, so
    state-dict names stay the block's), run over the expert-parallel ``group``."""

    def __init__(self, block: nn.Module, family: MoEFamily, group, ep: int, ep_rank: int, sp_group=None,
                 capacity_factor: float | None = None, fold_group=None, etp_group=None):
        nn.Module.__init__(self)  # not the block class's (see expert_parallel)
        self.family, self.group, self.sp_group, self.capacity_factor = family, group, sp_group, capacity_factor
        self.fold_group = fold_group  # the tp ranks of an ep group, alike tokens: each dispatches its share
        self.etp_group = etp_group  # the tp ranks each expert is split over (see .expert_tp), alike tokens
        check_block(type(block).__name__, block, family, ep)
        self.num_experts, self.top_k = family.num_experts(block), family.top_k(block)
        count = self.num_experts // ep
        self.first = ep_rank * count
        self.gate = block.gate
        self.experts = nn.ModuleDict({str(i): block.experts[i] for i in range(self.first, self.first + count)})
        if family.shared_expert:
            self.shared_expert, self.shared_expert_gate = block.shared_expert, block.shared_expert_gate
        self.jitter_noise = getattr(block, "jitter_noise", 0.0) if family.jitter else 0.0
        self._route = family.route(block)
        if hasattr(block, "config"):  # litgpt's blocks keep their config (read by user code)
            self.config = block.config

    def forward(self, hidden_states: torch.Tensor):
        shape = hidden_states.shape
        if self.training and self.jitter_noise > 0:  # as Mixtral: in place, on the caller's tensor
            hidden_states *= torch.empty_like(hidden_states).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
        x = hidden_states.reshape(-1, shape[-1])
        logits = self.gate(x)
        weights, idx = self._route(logits, x.dtype)
        split = (self.fold_group, self.etp_group, self.sp_group is not None)
        mine, weights, idx = enter(x, weights, idx, *split)
        capacity = None if self.capacity_factor is None else \
            capacity_of(self.capacity_factor, mine.shape[0], self.top_k, self.num_experts)
        rows, per_expert, handle = dispatch(mine, idx, self.num_experts, self.group, capacity)
        y = leave(combine(self._experts(rows, per_expert), weights, handle, self.group), x.shape[0], *split)
        if self.family.shared_expert:
            y = y + F.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        y = y.reshape(shape)
        if not self.family.returns_logits:
            return y
        if self.sp_group is not None:  # on sequence shards: the router statistics want the whole sequence
            logits = comm.gather_to_full_sp(logits.view(shape[0], shape[1], -1), self.sp_group, dim=1)
            logits = logits.reshape(-1, logits.shape[-1])
        return y, logits

    def _experts(self, rows: torch.Tensor, per_expert: list) -> torch.Tensor:
        """This rank's experts on their runs of ``rows``: grouped GEMMs where they can be and pay, else one at a time."""
        experts = list(self.experts.values())
        if not self.family.calls_idle:  # as the family's own loop: an expert no row chose keeps no gradient
            experts, per_expert = [e for e, n in zip(experts, per_expert) if n], [n for n in per_expert if n]
            if not experts:
                return rows
        with bias_on_first(down_biases(experts), self.etp_group):
            y = grouped_forward(experts, rows, per_expert) if runs_grouped(rows) else None
            if y is None:
                y = torch.cat([expert(chunk) for expert, chunk in zip(experts, rows.split(per_expert))])
        return y

    def extra_repr(self) -> str:
        return (f"{self.family.name}: experts {self.first}..{self.first + len(self.experts) - 1} of "
                f"{self.num_experts} here, top_k={self.top_k}, ep={comm.group_size(self.group)}"
                + (f", etp={comm.group_size(self.etp_group)}" if self.etp_group is not None else "")
                + (f", capacity factor {self.capacity_factor}" if self.capacity_factor is not None else ""))


def expert_parallel(block: nn.Module, family: MoEFamily, group, ep: int, ep_rank: int,
                    sp_group=None, capacity_factor: float | None = None, fold_group=None,
                    etp_group=None) -> ExpertParallelMoE:
    """An :class:`ExpertParallelMoE` for ``block`` that is also an instance of the block's class, so code
    that finds MoE blocks by class (Hugging Face's router-logit recorders) still finds it."""
    return as_block(ExpertParallelMoE, block, family, group, ep, ep_rank, sp_group, capacity_factor, fold_group,
                    etp_group)


def as_block(base: type, block: nn.Module, *args) -> ExpertParallelMoE:
    """``base(block, *args)`` (an :class:`ExpertParallelMoE` class) made an instance of ``block``'s class too."""
    cls = both(base, type(block))
    new = cls.__new__(cls)
    base.__init__(new, block, *args)
    return new
