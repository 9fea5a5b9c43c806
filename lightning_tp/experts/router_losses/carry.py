"""Router logits that travel with a pipeline's hidden states, so the last stage's load-balancing loss
(Hugging Face ``output_router_logits``) takes every layer's logits as one device does, and its gradient
goes back with the activation's. See docs/experts.md (Router losses under a pipeline)."""

from __future__ import annotations

import functools
import sys

from torch import nn

from ... import comm
from . import statistics as router_statistics
from . import switch as switch_losses
from ..families import SWITCH, find_moe_blocks
from ..blocks.fused import router_of
from ..blocks.layer import ExpertParallelMoE


def takes_logits(block: nn.Module, family) -> bool:
    """Whether a Hugging Face load-balancing loss takes ``block``'s router logits (its modeling module has one)."""
    module = sys.modules.get(modeling_module(block))
    return (family.returns_logits or family.fused or family is SWITCH) and \
        getattr(module, "load_balancing_loss_func", None) is not None


def modeling_module(block: nn.Module) -> str:
    """The module defining ``block``'s class (for an expert-parallel one, the class it replaced)."""
    return next(k for k in type(block).__mro__ if not issubclass(k, ExpertParallelMoE)).__module__


def _moe_blocks(model: nn.Module, declared) -> list:
    """(block, family) of the MoE blocks of ``model``, expert-parallel ones included."""
    found = [(block, family) for _, block, family in find_moe_blocks(model, declared)]
    return found + [(m, m.family) for m in model.modules() if isinstance(m, ExpertParallelMoE)]


def carried_logits(model: nn.Module, layout, declared=()) -> tuple | None:
    """Before the cut: per block of ``layout`` the expert counts of its MoE layers whose logits the loss takes,
    their modeling modules, and an encoder-decoder's two block lists (path, length); None where there are none or the
    model's config does not ask for them (Switch Transformers' forward asks by default: always carried)."""
    blocks = find_moe_blocks(model, declared)
    found = [(path, family.num_experts(block), modeling_module(block))
             for path, block, family in blocks if takes_logits(block, family)]
    asks = any(getattr(getattr(m, "config", None), "output_router_logits", False) is True for m in model.modules())
    if not found or not (asks or any(family is SWITCH for _, _, family in blocks)):
        return None
    names = layout.blocks(model)
    widths = [[e for path, e, _ in found if path.startswith(names.name(i) + ".")] for i in range(len(names))]
    return widths, sorted({module for _, _, module in found}), layout.lists


class RouterCarry:
    """Hands each virtual stage's router logits on behind its hidden states (``stage.tail``), and gives the
    last stage's loss the earlier stages' (:meth:`whole`). ``sp_group``: logits travel as sequence shards."""

    def __init__(self, stage, widths: list, sp_group=None, decoder_start=None):
        self.stage, self.sp_group = stage, sp_group
        self.own = (None, [], [])  # (the run, the logits its blocks returned, their stacks: an encoder-decoder's)
        self.before = [[e for block in widths[:lo] for e in block] for lo, _ in stage.ranges]
        stage.tail = lambda vstage: self.before[vstage]
        if decoder_start is not None:  # an encoder-decoder: the stack (encoder / decoder) of each carried logit
            stacks = [["decoder" if b >= decoder_start else "encoder" for b in range(lo) for _ in widths[b]]
                      for lo, _ in stage.ranges]
            stage.tail_stacks, stage.decoder_start = (lambda vstage: stacks[vstage]), decoder_start

    def collect(self, block, args, kwargs, out) -> None:
        """A forward hook on an MoE block: its router logits join the run's tail, shaped like its input's
        leading dimensions (this rank's sequence shard where the block gathered them, see .layer)."""
        if self.stage.replay is not None:  # a backward's recomputation: the forward run has them
            return
        x = args[0] if args else kwargs["hidden_states"]
        logits = block.__dict__.get("_lightning_tp_router_logits")  # a 5.x router's (GPT-OSS's block returns scores)
        logits = out[1] if logits is None else logits
        lead, run = x.shape[:-1], self.stage.run
        if self.own[0] is not run:
            self.own = (run, [], [])
        self.own[1].append(logits)
        self.own[2].append(block.__dict__.get("_lightning_tp_stack"))
        if logits.shape[0] != lead.numel() and self.sp_group is not None:
            shard, rank = lead[1], comm.group_rank(self.sp_group)
            logits = logits.view(lead[0], -1, logits.shape[-1])
            # Switch's block routes the whole sequence alike on every tp rank: its router takes every shard's gradient
            logits = comm.scatter_to_sp(logits, self.sp_group, dim=1) if getattr(block, "family", None) is SWITCH \
                else logits[:, rank * shard:(rank + 1) * shard]
        run.tail.append(logits.reshape(*lead, logits.shape[-1]))

    def whole(self, gate_logits: tuple) -> tuple:
        """Every layer's logits for the loss: the earlier stages' (received) first, then this stage's own
        (``gate_logits`` less what layers another stage ran stood in with)."""
        run, mine, _ = self.own
        mine = mine if run is self.stage.run else []
        own = tuple(g for g in gate_logits if any(g is m for m in mine))
        carried = []
        for c in map(self._whole_sequence, self.stage.run.carried):
            carried.append(c.reshape(-1, c.shape[-1]).to(own[0].dtype if own else c.dtype))
        return tuple(carried) + own

    def stack_logits(self, stack: str) -> list:
        """An encoder-decoder's (Switch Transformers') router logits of every MoE layer of ``stack``: the earlier
        stages' (received), then this stage's own."""
        run, mine, stacks = self.own
        own = [g for g, s in zip(mine, stacks) if s == stack] if run is self.stage.run else []
        carried = [self._whole_sequence(c)
                   for c, s in zip(self.stage.run.carried, self.stage.tail_stacks(self.stage.run.vstage)) if s == stack]
        return carried + own

    def _whole_sequence(self, carried):
        """A received logit over the whole sequence (under sp it travelled as this rank's shard)."""
        return carried if self.sp_group is None else comm.gather_to_full_sp(carried, self.sp_group, dim=1)


def install(model: nn.Module, stage, carried: tuple, dp_group, pp: int, sp_group=None, declared=()) -> RouterCarry:
    """Carry the router logits of ``model``'s MoE blocks this rank runs through ``stage``; ``carried``: what
    :func:`carried_logits` found before the cut. See RouterCarry."""
    widths, modules, lists = carried
    decoder_start = lists[0][1] if lists else None
    carry = RouterCarry(stage, widths, sp_group, decoder_start)
    for name in modules:  # also where this rank holds none of the blocks
        router_statistics.install_for(name, dp_group, pp)
        router_statistics.carry_for(name, carry)
    switch = []
    for block, family in _moe_blocks(model, declared):
        if takes_logits(block, family) and not any(p.is_meta for p in block.parameters()):
            switch += [block] if family is SWITCH else []
            if family.fused:  # transformers 5.x: the block returns hidden states only; its router has the logits
                router_of(block).register_forward_hook(functools.partial(_keep_logits, block, 0))
            if family is SWITCH:  # its router returns (dispatch mask, weights, logits)
                block.router.register_forward_hook(functools.partial(_keep_logits, block, 2))
            block.register_forward_hook(carry.collect, with_kwargs=True)
    if decoder_start is not None:
        switch_losses.install(model, carry, [path for path, _ in lists], switch)
    return carry


def _keep_logits(block, index, router, args, out) -> None:
    """A router's logits (its output ``index``), kept on its block for :meth:`RouterCarry.collect`."""
    block._lightning_tp_router_logits = out[index]
