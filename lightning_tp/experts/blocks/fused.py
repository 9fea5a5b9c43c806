"""Expert parallelism for transformers 5.x experts: one module holding every expert as 3-D parameters
``[E, ...]``, called as ``experts(hidden [N, H], top_k_index [N, k], top_k_weights [N, k])``. The
model's own router and the family's own per-expert math stay; only the experts call is distributed."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ... import comm
from ...layers.shard import ShardSpec, shard
from ...marks import set_marks
from ..dispatch import capacity_of, combine, dispatch
from ..expert_tp import bias_on_first, enter, fused_widths, leave


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
        total, split = hidden_states.shape[0], (ep["fold"], ep["etp"], ep["sp"])
        hidden_states, top_k_weights, top_k_index = enter(hidden_states, top_k_weights, top_k_index, *split)
        capacity = None if ep["capacity"] is None else \
            capacity_of(ep["capacity"], hidden_states.shape[0], top_k_index.shape[-1], ep["experts"])
        rows, per_expert, handle = dispatch(hidden_states, top_k_index, ep["experts"], ep["group"], capacity)
        local = torch.repeat_interleave(torch.arange(len(per_expert), device=rows.device),
                                        torch.tensor(per_expert, device=rows.device)).unsqueeze(1)
        ones = torch.ones(rows.shape[0], 1, dtype=top_k_weights.dtype, device=rows.device)
        with bias_on_first([(self, "down_proj_bias")], ep["etp"]):
            y = super().forward(rows, local, ones)  # the family's math on its own rows, weighted after the return
        return leave(combine(y, top_k_weights, handle, ep["group"]), total, *split)


_CLASSES: dict = {}


def both(base: type, kind: type) -> type:
    """The class ``ExpertParallel<kind>`` deriving from ``base`` and ``kind`` (made once per pair): an expert-parallel
    module is still an instance of the family's class, for code that finds it by class."""
    if (base, kind) not in _CLASSES:
        _CLASSES[base, kind] = type(f"ExpertParallel{kind.__name__}", (base, kind), {})
    return _CLASSES[base, kind]


def expert_slice(p: torch.Tensor, ep: int, ep_rank: int) -> tuple:
    """Rank ``ep_rank``'s experts of a 3-D parameter ``[E, ...]`` (a view) and where they sit in the whole one
    (None at ep=1), for checkpoints written as chunks of the single-device tensor."""
    count = p.shape[0] // ep
    spec = ShardSpec(dim=0, world=ep, full=p.shape[0], at_rank=ep_rank) if ep > 1 else None
    return p.detach()[ep_rank * count:(ep_rank + 1) * count], spec


def expert_parallel_experts(experts: nn.Module, group, ep: int, ep_rank: int, capacity_factor=None,
                            fold=None, etp=None, tp_rank: int = 0, sp: bool = False, etp_size: int = 0) -> nn.Module:
    """Keep experts ``[ep_rank * E/ep, (ep_rank + 1) * E/ep)`` of ``experts`` in place, calls expert-parallel over
    ``group``; ``fold``: the tp ranks splitting the tokens; ``etp``: the tp ranks splitting each expert's width
    (slice ``tp_rank`` of them; ``etp_size``: their count without a group, in explain's copies)."""
    total, count = experts.num_experts, experts.num_experts // ep
    first, world = ep_rank * count, etp_size or comm.group_size(etp)
    widths = fused_widths(experts)
    for name, p in list(experts.named_parameters(recurse=False)):
        if p.dim() == 0 or p.shape[0] != total:
            raise ValueError(f"{type(experts).__name__}.{name} has shape {tuple(p.shape)}: expert parallelism expects "
                             f"every parameter of a fused experts module to lead with its {total} experts.")
        sliced, spec = expert_slice(p, ep, ep_rank)
        if world > 1 and widths.get(name) is not None:  # the expert's width over the tp ranks too
            dim, blocks = widths[name]
            inner = ShardSpec(dim=dim, world=world, full=p.shape[dim], chunks=blocks, at_rank=tp_rank)
            sliced, spec = shard(sliced, inner, tp_rank), inner if spec is None else dataclasses.replace(spec, inner=inner)
        param = nn.Parameter(sliced.clone(), requires_grad=p.requires_grad)
        set_marks(param, expert=ep > 1, tp_spec=spec, sp_partial=world > 1 and widths.get(name, 0) is None)
        setattr(experts, name, param)
    experts.__class__ = both(ExpertParallelExperts, type(experts))
    experts.num_experts = count  # the class's own forward sees local expert ids 0..count-1
    experts._lightning_tp_ep = dict(experts=total, group=group, capacity=capacity_factor, first=first, fold=fold,
                                    etp=etp if world > 1 else None, sp=sp)
    return experts


def gather_router_logits(block: nn.Module, sp_group) -> None:
    """On sequence shards: the router logits a loss records (output 0 of the router) span the whole sequence,
    as one device's do; the routing itself stays on this rank's tokens."""
    from ... import comm

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
