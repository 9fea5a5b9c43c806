"""Expert parallelism for transformers 5.x experts: one module holding every expert as 3-D parameters
``[E, ...]``, called as ``experts(hidden [N, H], top_k_index [N, k], top_k_weights [N, k])``. The
model's own router and the family's own per-expert math stay; only the experts call is distributed."""

from __future__ import annotations

import torch
from torch import nn

from .. import comm
from ..layers.shard import ShardSpec
from ..marks import set_marks
from .dispatch import capacity_of, combine, dispatch


def is_fused_experts(module) -> bool:
    """A transformers 5.x experts module (``use_experts_implementation``): every expert in 3-D parameters."""
    return isinstance(module, nn.Module) and hasattr(module, "is_transposed") and hasattr(module, "num_experts")


def router_of(block: nn.Module):
    """The router beside a fused ``experts`` module: ``gate`` (Mixtral, Qwen, DeepSeek) or ``router`` (GPT-OSS)."""
    return next((getattr(block, n) for n in ("gate", "router") if isinstance(getattr(block, n, None), nn.Module)),
                None)


class ExpertParallelExperts:
    """Mixin put before a fused experts class: dispatch (token, slot) pairs by ``top_k_index`` to the ranks
    holding their experts, run the class's own forward on this rank's experts, combine with the weights."""

    def forward(self, hidden_states, top_k_index, top_k_weights):
        ep = self._lightning_tp_ep
        fold, total = ep["fold"], hidden_states.shape[0]
        if fold is not None:  # tokens alike on the tp ranks of an ep group: each dispatches its share of rows
            hidden_states, top_k_weights = comm.scatter_to_rows(hidden_states, fold), \
                comm.scatter_to_rows(top_k_weights, fold)
            top_k_index = comm.split_rows(top_k_index, fold)
        capacity = None if ep["capacity"] is None else \
            capacity_of(ep["capacity"], hidden_states.shape[0], top_k_index.shape[-1], ep["experts"])
        rows, per_expert, handle = dispatch(hidden_states, top_k_index, ep["experts"], ep["group"], capacity)
        local = torch.repeat_interleave(torch.arange(len(per_expert), device=rows.device),
                                        torch.tensor(per_expert, device=rows.device)).unsqueeze(1)
        ones = torch.ones(rows.shape[0], 1, dtype=top_k_weights.dtype, device=rows.device)
        y = super().forward(rows, local, ones)  # the family's math on its own rows, weighted after the return
        y = combine(y, top_k_weights, handle, ep["group"])
        return y if fold is None else comm.gather_from_rows(y, total, fold)


_CLASSES: dict = {}


def expert_parallel_experts(experts: nn.Module, group, ep: int, ep_rank: int, capacity_factor=None,
                            fold=None) -> nn.Module:
    """Keep experts ``[ep_rank * E/ep, (ep_rank + 1) * E/ep)`` of ``experts`` (in place: parameter names stay),
    and make its calls expert-parallel over ``group``; ``fold``: the tp group whose ranks split the tokens."""
    total, count = experts.num_experts, experts.num_experts // ep
    first = ep_rank * count
    for name, p in list(experts.named_parameters(recurse=False)):
        if p.dim() == 0 or p.shape[0] != total:
            raise ValueError(f"{type(experts).__name__}.{name} has shape {tuple(p.shape)}: expert parallelism expects "
                             f"every parameter of a fused experts module to lead with its {total} experts.")
        sliced = nn.Parameter(p.detach()[first:first + count].clone(), requires_grad=p.requires_grad)
        spec = ShardSpec(dim=0, world=ep, full=total, at_rank=ep_rank) if ep > 1 else None
        setattr(experts, name, set_marks(sliced, expert=ep > 1, tp_spec=spec))
    kind = type(experts)
    if kind not in _CLASSES:
        _CLASSES[kind] = type(f"ExpertParallel{kind.__name__}", (ExpertParallelExperts, kind), {})
    experts.__class__ = _CLASSES[kind]
    experts.num_experts = count  # the class's own forward sees local expert ids 0..count-1
    experts._lightning_tp_ep = dict(experts=total, group=group, capacity=capacity_factor, first=first, fold=fold)
    return experts


def gather_router_logits(block: nn.Module, sp_group) -> None:
    """On sequence shards: the router logits a loss records (output 0 of the router) span the whole sequence,
    as one device's do; the routing itself stays on this rank's tokens."""
    from .. import comm

    router, lead = router_of(block), {}

    def remember(module, args, kwargs):
        x = args[0] if args else kwargs["hidden_states"]
        lead["shape"] = tuple(x.shape[:-1])

    def gather(module, args, out):
        shape = lead.get("shape")
        if not isinstance(out, tuple) or shape is None or len(shape) != 2 or out[0].shape[0] != shape[0] * shape[1]:
            return out
        logits = comm.gather_to_full_sp(out[0].view(*shape, -1), sp_group, dim=1)
        return (logits.reshape(-1, logits.shape[-1]),) + tuple(out[1:])

    block.register_forward_pre_hook(remember, with_kwargs=True)
    router.register_forward_hook(gather)
