"""ParallelConfig: MegaStrategy's options checked and resolved once, then handed to everything that
builds or models a layout (parallelize, explain). What depends on the model (the split backward,
Hugging Face's checkpointing) is resolved per model by :meth:`ParallelConfig.for_model`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Union

from .recompute import full as recompute
from .context.checks import check_context_parallel
from .kernels.inject import kernel_names
from .mesh import data_parallel_size
from .pipeline.schedule.schedules import build_schedule, resolve_split_backward
from .quant import bits_of
from .quant.fake_quant import RANGE_MODES
from .dp.zero.fsdp import check_zero3

P2P_MODES = ("auto", "eager", "batched")
ZERO_STAGES = (0, 1, 3)


@dataclass(frozen=True)
class ModelChoices:
    """What a layout does on one model: blocks recomputed (the option, or Hugging Face's gradient
    checkpointing taken over under a pipeline) and the backward split that follows."""

    recompute: Union[bool, int]
    hf_recompute: bool
    split_backward: Union[bool, str]


@dataclass(frozen=True)
class ParallelConfig:
    """One run's layout and options, every value checked; ``dp`` is None until the world size is known."""

    tp: int = 1
    pp: int = 1
    sp: bool = False
    cp: int = 1
    cp_attention: str = "ring"
    dp: Optional[int] = None
    ep: int = 1
    etp: int = 1
    moe_capacity: Optional[float] = None
    zero: int = 0
    microbatches: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    split_backward: Union[bool, str] = "auto"
    pipeline_blocks: Any = None
    stage_layers: Optional[tuple] = None
    activation_checkpointing: Union[bool, int] = False
    selective: bool = False  # activation_checkpointing="selective": the attention core only (see .selective)
    zb_keep_recomputed: bool = False
    p2p: str = "auto"
    kernels: tuple = ()
    quant: Optional[str] = None
    quant_range: str = "ema"
    load_full: Optional[str] = None
    plan: Any = "auto"
    sync_init: bool = True
    broadcast_batch: bool = True

    @classmethod
    def resolve(cls, tp: int = 1, pp: int = 1, sp: bool = False, ep: int = 1, etp: int = 1, moe_capacity: Optional[float] = None,
                zero: int = 0, microbatches: Optional[int] = None,
                schedule: str = "1f1b", virtual_stages: int = 1, split_backward="auto", pipeline_blocks=None,
                stage_layers=None, activation_checkpointing=False, zb_keep_recomputed: bool = False,
                p2p: str = "auto", kernels=False, quant: Optional[str] = None, quant_range: str = "ema",
                load_full: Optional[str] = None, plan: Any = "auto", sync_init: bool = True,
                broadcast_batch: bool = True, world_size: Optional[int] = None, cp: int = 1,
                cp_attention: str = "ring") -> "ParallelConfig":
        """Check every option (the same errors on every rank, before any process group) and fill the
        defaults; ``sp`` without tp > 1 becomes False (MegaStrategy warns about it)."""
        data_parallel_size(tp * pp if isinstance(tp, int) and isinstance(pp, int) else 1, tp, pp)  # types
        microbatches = microbatches if microbatches is not None else pp
        for name, value in (("microbatches", microbatches), ("virtual_stages", virtual_stages), ("ep", ep), ("etp", etp), ("cp", cp)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MegaStrategy({name}={value!r}): {name} must be a positive integer.")
        check_context_parallel(cp, cp_attention, ep=ep, zero=zero, broadcast_batch=broadcast_batch)
        check_etp_option(etp, tp, zero, quant, ep)
        if p2p not in P2P_MODES:
            raise ValueError(f"MegaStrategy(p2p={p2p!r}): choose 'auto', 'eager' or 'batched'.")
        if moe_capacity is not None and (isinstance(moe_capacity, bool) or not isinstance(moe_capacity, (int, float))
                                         or not 0 < moe_capacity <= 64):
            raise ValueError(f"MegaStrategy(moe_capacity={moe_capacity!r}): a capacity factor is a number in (0, 64] "
                             f"(1.0: each expert takes its even share of a rank's tokens x top_k); None is dropless.")
        if zero not in ZERO_STAGES or isinstance(zero, bool):
            raise ValueError(f"MegaStrategy(zero={zero!r}): choose 0 (every dp replica keeps the whole optimizer "
                             f"state), 1 (optimizer state sharded over dp) or 3 (parameters, gradients and optimizer "
                             f"state sharded over dp).")
        pipelined = pp > 1 or microbatches > 1
        if zero == 3:
            check_zero3(pp, microbatches, ep, quant)
        whole_blocks = activation_checkpointing if activation_checkpointing != "selective" else False
        split_default = resolve_split_backward(split_backward, schedule, pp, whole_blocks)
        if pipelined:  # names and counts
            build_schedule(schedule, pp, microbatches, virtual_stages, split_default)
        if quant is not None:
            bits_of(quant)
        if quant_range not in RANGE_MODES:
            raise ValueError(f"MegaStrategy(quant_range={quant_range!r}): choose one of {list(RANGE_MODES)}.")
        if quant is None and quant_range != "ema":
            raise ValueError(f"MegaStrategy(quant_range={quant_range!r}) needs quant='int8' or 'w4a8' as well.")
        recompute.check_option(activation_checkpointing, quant, schedule if pipelined else None,
                               zb_keep_recomputed, split_default)
        selective = activation_checkpointing == "selective"
        config = cls(tp=tp, pp=pp, sp=bool(sp) and tp > 1, cp=cp, cp_attention=cp_attention, ep=ep, etp=etp, moe_capacity=moe_capacity,
                     zero=zero, microbatches=microbatches, schedule=schedule,
                     virtual_stages=virtual_stages, split_backward=split_backward, pipeline_blocks=pipeline_blocks,
                     stage_layers=tuple(stage_layers) if stage_layers is not None else None,
                     activation_checkpointing=whole_blocks, selective=selective,
                     zb_keep_recomputed=zb_keep_recomputed, p2p=p2p, kernels=kernel_names(kernels), quant=quant, quant_range=quant_range,
                     load_full=load_full, plan=plan, sync_init=sync_init, broadcast_batch=broadcast_batch)
        return config.with_world(world_size) if world_size is not None else config

    def with_world(self, world_size: int) -> "ParallelConfig":
        """The same options with dp set from the world size (an error saying what to set if tp*pp does not
        divide it, or ep a stage's tp x cp x dp ranks)."""
        dp = data_parallel_size(world_size, self.tp, self.pp, self.cp)
        stage = self.tp * self.cp * dp
        if self.etp > 1 and (stage // self.etp) % self.ep:
            names = "dp" if self.cp == 1 else "cp x dp"
            names = names if self.etp == self.tp else f"tp / etp x {names}"
            raise ValueError(f"MegaStrategy(ep={self.ep}, etp={self.etp}): with each expert split over etp tp ranks, "
                             f"ep splits the experts over a stage's {names} ranks ({stage // self.etp}: world "
                             f"{world_size} / (etp={self.etp} x pp={self.pp})); ep must divide {stage // self.etp}. "
                             f"Change ep, etp=1 (ep over tp ranks too), or devices/num_nodes.")
        if stage % self.ep:
            names = "tp x dp" if self.cp == 1 else "tp x cp x dp"
            raise ValueError(f"MegaStrategy(ep={self.ep}) splits the experts over ep of a stage's {stage} ranks "
                             f"({names}: world {world_size} / pp={self.pp}): ep must divide {stage}. Change ep, "
                             f"or devices/num_nodes.")
        return dataclasses.replace(self, dp=dp)

    @property
    def pipelined(self) -> bool:
        """Whether steps run through the pipeline runner (pp > 1, or microbatches without stages)."""
        return self.pp > 1 or self.microbatches > 1

    @property
    def world_size(self) -> Optional[int]:
        return None if self.dp is None else self.tp * self.cp * self.pp * self.dp

    def for_model(self, hf_recompute: bool, encoder_decoder: bool) -> ModelChoices:
        """The choices that depend on the model: ``hf_recompute`` (Hugging Face gradient checkpointing on,
        taken over under pp > 1) counts as recomputation; ``encoder_decoder``: two block lists staged."""
        hf = bool(hf_recompute) and self.pp > 1
        blocks = self.activation_checkpointing or hf
        split = resolve_split_backward(self.split_backward, self.schedule, self.pp, blocks, encoder_decoder)
        recompute.check_option(blocks, self.quant, self.schedule if self.pipelined else None,
                               self.zb_keep_recomputed, split)
        return ModelChoices(recompute=blocks, hf_recompute=hf, split_backward=split)


def check_etp_option(etp: int, tp: int, zero: int, quant, ep: int = 1) -> None:
    """``etp`` (each expert's MLP split over etp of the tp ranks, Megatron's expert tensor parallelism): a
    divisor of tp; below tp only with ep > 1 (the other tp ranks then hold other experts or other tokens)."""
    if tp % etp:
        raise ValueError(f"MegaStrategy(etp={etp}, tp={tp}): etp splits each expert over etp of the tp ranks: choose "
                         f"etp=1 (experts whole, ep may span tp ranks), etp=tp={tp} or another divisor of tp.")
    if 1 < etp < tp and ep == 1:
        raise ValueError(f"MegaStrategy(etp={etp}, tp={tp}, ep=1): an etp below tp folds the other tp ranks into "
                         f"expert parallelism; set ep > 1 (ep x etp ranks hold one copy of the experts), or etp={tp}.")
    if etp > 1 and zero == 3:
        raise ValueError(f"MegaStrategy(etp={etp}, zero=3): zero=3 keeps experts whole (ep=1, etp=1); use zero=1 or etp=1.")
    if etp > 1 and quant is not None:
        raise ValueError(f"MegaStrategy(etp={etp}, quant={quant!r}): QAT's experts are not split over tp yet; use etp=1.")
