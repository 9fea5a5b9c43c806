"""What a MegaStrategy layout will hold and send, before any process starts.

Counted by the strategy's own code on meta-device copies; the cost model: docs/design/explain.md."""

from __future__ import annotations

import copy
import dataclasses
import warnings
from fractions import Fraction
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from ..dp.grads import chunked, replica_buffer_numel
from ..pipeline.cut.block_lists import block_at, block_key
from ..pipeline.schedule.schedules import build_schedule
from ..pipeline.schedule.simulate import simulate
from ..tp_in_pp.sp_stages import chain_index
from ..pipeline.cut.outer_modules import outer_groups
from ..pipeline.cut.split import apply_split
from ..plans import checks
from ..plans import lookup
from ..plans import swap
from ..recompute import full as recompute
from ..config import ParallelConfig
from ..context.chunks import check_length
from ..context.costs import ring_bytes, ring_flop_per_byte
from ..context.model_checks import check_model
from ..mesh import ParallelMesh
from ..layout import block_places, stage_layout
from ..dp.sync import fsdp_blocks
from .costs import (
    cost_entries,
    saved_scores,
    saved_widths,
    t5_head_counts,
    t5_shares_its_bias,
    t5_side,
    tp_ops,
    weight_grad_widths,
    width_in,
)
from ..experts.apply import check_experts
from ..experts.families import LLAMA4, SWITCH, find_moe_blocks
from ..experts.expert_tp import shard_experts
from ..experts.blocks.fused import expert_parallel_experts, router_of
from ..experts.blocks.layer import expert_parallel
from ..experts.blocks.llama4 import llama4_parallel
from ..experts.blocks.switch import switch_parallel
from ..marks import marks_of, set_marks
from ..dp.overlap import DPOverlap
from ..dp.zero import ShardedOptimizer
from ..dp.zero.fsdp import check_zero3
from .printed import format_report
from .split_backward import split_decisions


@dataclass
class RankEstimate:
    """One (pipeline stage, tp rank); dp replicas are alike. Bytes per optimizer step."""

    stage: int
    tp_rank: int
    params: int
    tp_bytes: int = 0
    pp_bytes: int = 0
    sp_bytes: int = 0
    tied_bytes: int = 0
    dp_bytes: int = 0
    act_bytes: int = 0
    peak_microbatches: int = 1
    recompute_bytes: int = 0  # of act_bytes: one recomputed block's activations, during its backward
    tp_recompute_bytes: int = 0  # of tp_bytes: at most, recomputed blocks' forward collectives run again
    zb_w_bytes: int = 0  # ZB-H1: what one microbatch keeps from its B until its W (0: not ZB-H1)
    expert_params: int = 0  # of params: this rank's experts (1/ep of its stage's under ep)
    ep_bytes: int = 0  # ep > 1: expert dispatch all-to-alls (rows both ways, forward and backward, and counts)
    cp_bytes: int = 0  # cp > 1: the ring's sends (K/V forward, again in backward, and dK/dV in fp32)
    edp_bytes: int = 0  # ep > 1: expert gradients summed over the ranks holding the same experts
    # memory held through the step (dp rank 0's: zero=1's padding falls on the last): weights, gradients at the
    # optimizer step (zero=1: this rank's slices), the whole ones the backward makes, optimizer state
    weight_bytes: int = 0
    grad_held_bytes: int = 0
    grad_whole_bytes: int = 0
    optim_state_bytes: int = 0
    weight_gathered_bytes: int = 0  # zero=3: whole weights gathered at once at most (the root's and two blocks')
    dp_ops: list = field(default_factory=list)  # gradient collectives per step: (op, "dp"/"edp", calls, bytes)


@dataclass
class Explanation:
    config: dict
    styles: list = field(default_factory=list)  # (path pattern, style, count)
    stages: list = field(default_factory=list)  # (virtual stage, pp rank, first block, last block)
    outer: dict = field(default_factory=dict)  # {"first": [paths], "last": [paths]}
    layer_ops: list = field(default_factory=list)  # TP collectives of block 0: (op, elements per token)
    decoder_ops: list = field(default_factory=list)  # an encoder-decoder's: those of the decoder's block 0
    ranks: list = field(default_factory=list)
    actions: list = field(default_factory=list)  # under a pipeline: each pp rank's action list, as the run's
    # a split backward (pp > 1): per block class, the custom Functions B takes whole, and the weight groups
    # deferred to W (None: the block could not run alone, decided at the first step); see .split_backward
    split_in_b: dict = field(default_factory=dict)
    split_deferred: dict = field(default_factory=dict)
    cp_flop_per_byte: float = 0.0  # cp > 1 (ring): attention FLOPs per byte sent in one ring step (the overlap)

    def rank(self, stage: int, tp_rank: int = 0) -> RankEstimate:
        return next(r for r in self.ranks if (r.stage, r.tp_rank) == (stage, tp_rank))

    def as_dict(self) -> dict:  # plain data, e.g. for json.dumps
        return asdict(self)

    def __str__(self) -> str:
        return format_report(self)


def _meta_copy(module: nn.Module) -> nn.Module:
    """Same structure, parameters on meta (ties and requires_grad kept), no Trainer copied."""
    memo = {id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
            for p in module.parameters()}
    memo.update({id(b): torch.empty_like(b, device="meta") for b in module.buffers()})
    trainer = module.__dict__.get("_trainer")
    if trainer is not None:
        memo[id(trainer)] = None
    return copy.deepcopy(module, memo)


def _zb_held(actions, first: bool, to_b: float, to_w: float) -> float:
    """ZB-H1 on one rank: the most activation held at once, each microbatch holding ``to_b`` from its
    F to its B (the first stage: to its W, its B does nothing) and ``to_w`` from its B to its W."""
    n_b = n_w = 0
    most = 0.0
    for a in actions:
        if a.kind == "F":
            n_b += 1
        elif a.kind == "B" and not first:
            n_b, n_w = n_b - 1, n_w + 1
        elif a.kind == "W":
            if first:
                n_b -= 1
            else:
                n_w -= 1
        most = max(most, n_b * to_b + n_w * to_w)
    return most


def explain(module: nn.Module, tp: int = 1, pp: int = 1, sp: bool = False, microbatches=None,
            batch_shape=(8, 128), schedule: str = "1f1b", virtual_stages: int = 1, plan="auto", dp: int = 1,
            dtype_bytes: int = 4, *, grad_bytes=None, accumulate_grad_batches: int = 1, pipeline_blocks=None,
            stage_layers=None, activation_checkpointing=False, zb_keep_recomputed: bool = False,
            split_backward="auto", ep: int = 1, etp: int = 1, zero=None, optimizer_state_bytes=None, score_copies: int = 0,
            config: ParallelConfig | None = None, print_report: bool = True, cp: int = 1,
            cp_attention: str = "ring", ranks=None) -> Explanation:
    """Parameters, stages, communication and memory per rank (``ranks``: (stage, tp_rank) pairs, default all) of
    ``MegaStrategy(tp, pp, sp, ..., zero)`` with ``dp`` replicas on ``module`` (or of ``config``) for a per-replica ``batch_shape``
    (B, T); ``score_copies``: s x s tensors an attention core keeps per head (0: fused SDPA). Prints unless ``print_report=False``."""
    if getattr(module, "_lightning_tp", None) is not None:
        raise ValueError("explain() needs the user's module before MegaStrategy parallelized it.")
    if config is None:
        config = ParallelConfig.resolve(tp=tp, pp=pp, sp=sp, ep=ep, etp=etp, zero=0 if zero is None else zero, microbatches=microbatches,
                                        schedule=schedule, virtual_stages=virtual_stages,
                                        split_backward=split_backward, pipeline_blocks=pipeline_blocks,
                                        stage_layers=stage_layers, activation_checkpointing=activation_checkpointing,
                                        zb_keep_recomputed=zb_keep_recomputed, plan=plan, world_size=tp * cp * pp * dp,
                                        cp=cp, cp_attention=cp_attention)
    elif config.dp is None:
        raise ValueError("explain(config=...) needs a config with its world size: config.with_world(n).")
    elif zero is not None:  # checked as MegaStrategy checks it
        config = dataclasses.replace(config, zero=ParallelConfig.resolve(zero=zero).zero)
        if zero == 3:
            check_zero3(config.pp, config.microbatches, config.ep, config.quant)
    tp, pp, sp, m, dp, schedule = config.tp, config.pp, config.sp, config.microbatches, config.dp, config.schedule
    plan, pipeline_blocks, activation_checkpointing = config.plan, config.pipeline_blocks, config.activation_checkpointing
    v = config.virtual_stages if pp > 1 else 1
    (B, T), grad_bytes, acc = batch_shape, grad_bytes or dtype_bytes, accumulate_grad_batches
    cp = config.cp
    if cp > 1:
        check_length(T, cp)
        check_model(module, cp)
        T = T // cp  # this rank's tokens of every sequence
    state_bytes = 2 * grad_bytes if optimizer_state_bytes is None else optimizer_state_bytes  # AdamW's 2 moments
    if B % m:
        raise ValueError(f"microbatches={m} must divide the per-process batch size {B}.")
    base = _meta_copy(module)
    if config.ep > 1 or config.etp > 1 or config.moe_capacity is not None:  # refused as MegaStrategy refuses it
        check_experts(base, config.ep, config.moe_capacity, lookup.expert_styles(config.plan), config.etp)
    with warnings.catch_warnings():
        if tp == 1:
            warnings.simplefilter("ignore")  # styles shown for reference; nothing is applied at tp=1
        try:
            matches = checks.resolve(base, tp, sp, plan)
        except ValueError:
            if tp > 1:
                raise
            matches = []  # a plan usable only for its block list at tp=1 (styles not supported at tp > 1)
    pipelined = config.pipelined
    try:
        layout = stage_layout(dataclasses.replace(config, microbatches=max(m, 2)), base)
    except ValueError:
        if pipelined:
            raise
        if activation_checkpointing:
            raise ValueError("explain(activation_checkpointing=...) models the model's block list and found none; "
                             "name it with pipeline_blocks='path.to.blocks'.") from None
        layout = None  # no block list: the whole model is one stage
    hf_recompute = pp > 1 and bool(recompute.hf_checkpointing_modules(base, layout))
    choices = config.for_model(hf_recompute, bool(layout is not None and layout.lists))
    activation_checkpointing, split_backward = choices.recompute, choices.split_backward
    # one replay of the schedule: peak in-flight microbatches (set by each rank's action order alone) and
    # the idle share of a step with equal blocks, backward = 2 forwards (ZB: its halves alike), free transfers
    unit = {"F": Fraction(1, v), "B": Fraction(2, v), "W": Fraction(1, v)}
    actions = build_schedule(schedule, pp, m, v, split_backward) if pipelined else None
    replayed = simulate(actions, pp, v, unit) if pipelined else None
    peaks = replayed.peak_inflight if replayed else [1]
    bubble = float(replayed.bubble_fraction) if pp > 1 else 0.0

    bpath = layout.blocks_path if layout else None
    lists = (layout.lists or ((bpath, None),)) if layout else ()  # (path, length) per block list
    offset = {path: sum(n for _, n in lists[:i]) for i, (path, _) in enumerate(lists)}  # chain index of each's first
    runs = layout.runs() if layout else {"before": {0}, "between": set(), "decoder_in": set(), "after": {0}}
    decoder_parent = lists[-1][0].rpartition(".")[0] + "." if len(lists) > 1 else None
    order = {name: i for i, (name, _) in enumerate(base.named_modules())}

    positions = {lpath: {block_key(c, j): j for j in range(len(c))} for lpath in offset if lpath
                 for c in [base.get_submodule(lpath)]}  # a ModuleDict's blocks are named by their keys

    def locate(path):
        for lpath, first in offset.items():
            if path.startswith(lpath + "."):
                return ("block", first + positions[lpath][path[len(lpath) + 1:].split(".")[0]])
        if bpath is None or order[path] < order[lists[0][0]]:
            return ("first",)
        if len(lists) > 1 and order[path] < order[lists[1][0]]:
            return ("decoder_in",) if decoder_parent != "." and path.startswith(decoder_parent) else ("between",)
        return ("last",)

    def locate_end(path):
        """Where ``path``'s output is made: a stack holding a block list (an encoder) makes it at the
        list's last block, whatever stage that is; anything else where it sits."""
        i = chain_index(layout, path) if layout is not None else None
        return ("block", i) if i is not None else locate(path)

    def times(loc, r):
        """How often rank r runs ``loc`` per microbatch (an encoder-decoder's embedding copy may run twice)."""
        if loc[0] == "block":
            return int(layout.vstage_of(loc[1]) % pp == r)
        vstages = {"first": runs["before"], "last": runs["after"]}.get(loc[0]) or runs[loc[0]]
        return sum(k % pp == r for k in vstages) if layout else 1

    def message(k, grad=False):
        """Elements per token virtual stage k sends on (``grad``: its gradient, coming back): the hidden
        states, and inside an encoder-decoder's decoder the encoder's output too (same sequence length
        assumed); T5's blocks are also given its masks and position biases (see t5_side)."""
        shard = hidden / (tp if sp_on else 1)  # under SP a stack's hidden states travel as shards
        if not layout.lists:
            return shard
        nxt = layout.ranges[k + 1][0]  # the encoder's output (whole) once the decoder has begun
        out = hidden if nxt == layout.decoder_start else shard + (hidden if nxt > layout.decoder_start else 0)
        return out + (t5_side(nxt, layout.decoder_start, t5_heads // tp, T, grad, t5_shared) if t5_heads else 0)

    hidden = width_in(block_at(base.get_submodule(lists[0][0]), 0) if bpath else base)
    t5_heads = t5_head_counts(base) if layout is not None and layout.lists else None
    t5_shared = max(1, B // m) if t5_heads and t5_shares_its_bias(base) else 0
    ops, style_of = tp_ops(base, matches, sp, tp, hidden, locate, locate_end)
    sp_starts = {start for mt in matches if sp and tp > 1 and mt.sp_start is not None for start in mt.sp_starts()}
    width = saved_widths(base, style_of, tp, locate, fused=not score_copies, sp_starts=sp_starts)
    scores = saved_scores(base, style_of, tp, locate, T, score_copies)  # recomputed, not kept, under selective
    if not config.selective:
        for loc, n in scores.items():
            width[loc] += n
    w_grads = weight_grad_widths(base, style_of, tp, locate) if schedule == "zb_h1" else {}
    sp_on = any(sp and mt.sp_start is not None for mt in matches)

    rep = Explanation(dict(tp=tp, pp=pp, dp=dp, ep=config.ep, etp=config.etp, cp=cp, cp_attention=config.cp_attention,
                           world=tp * cp * pp * dp, sp=sp, microbatches=m, schedule=schedule,
                           virtual_stages=v, batch_shape=(B, T), dtype_bytes=dtype_bytes, grad_bytes=grad_bytes,
                           accumulate_grad_batches=acc, zero=config.zero, optimizer_state_bytes=state_bytes,
                           blocks=bpath, hidden=hidden, bubble=bubble,
                           split_backward=split_backward, activation_checkpointing=activation_checkpointing,
                           selective=config.selective, score_copies=score_copies,
                           plans=[(mt.prefix, mt.plan.name) for mt in matches]))
    rep.actions = [list(a) for a in actions] if actions is not None else []
    counts = {}
    for mt in matches:
        for path, style, _ in cost_entries(mt):
            lpath = next((lp for lp in offset if path.startswith(lp + ".")), None)
            key = (f"{lpath}.*.{path[len(lpath) + 1:].partition('.')[2]}".rstrip(".") if lpath else path, style)
            counts[key] = counts.get(key, 0) + 1
    rep.styles = [(p, s, c) for (p, s), c in counts.items()]
    if layout:
        rep.stages = [(k, k % pp, lo, hi) for k, (lo, hi) in enumerate(layout.ranges)]
        groups = outer_groups(base, list(offset), layout.companions)
        rep.outer = {"first": [n for n, _ in groups["before"]], "last": [n for n, _ in groups["after"]],
                     "between": [n for n, _ in groups["between"] + groups["decoder_in"]]}
        rep.layer_ops = list(ops[("block", 0)])
        rep.decoder_ops = list(ops[("block", layout.decoder_start)]) if layout.lists else []
        if pp > 1 and (split_backward or schedule == "zb_h1"):  # virtual stage 0 runs its backward whole
            rep.split_in_b, rep.split_deferred = split_decisions(module, offset, layout.ranges[0][1] + 1, hidden)
    tokens = B * T * acc
    tied_ranks = layout.replica_ranks() if layout and layout.lists else (0, pp - 1)
    n_blocks = layout.ranges[-1][1] + 1 if layout else 0
    for r in range(pp):
        mine = [(loc, times(loc, r)) for loc in set(ops) | set(width) if times(loc, r)]
        again = {offset[path] + i for path, i in recompute.targets(base, activation_checkpointing, layout, r)} \
            if activation_checkpointing else set()
        kept = {("block", i): hidden / (tp if sp_on else 1) if i in again else width[("block", i)]
                for i in range(n_blocks)}
        ranges = [(lo, hi) for k, (lo, hi) in enumerate(layout.ranges) if k % pp == r] if layout else []

        def heaviest(per_loc, r=r, ranges=ranges):  # this rank's heaviest chunk's blocks, and its outer modules
            return max((sum(per_loc.get(("block", i), 0) for i in range(lo, hi + 1)) for lo, hi in ranges),
                       default=0) + sum(per_loc.get((kind,), 0) for kind in ("first", "between", "decoder_in", "last")
                                        if times((kind,), r))
        # recomputing: one block at a time; ZB-H1's W keeps what it recomputes for the chunk until it ends
        # (not the first stage's, a plain backward; with zb_keep_recomputed B's is kept, counted in held)
        zb_w = schedule == "zb_h1" and r > 0
        transient = max((sum(width[("block", i)] for i in again if lo <= i <= hi) if zb_w
                         else max((width[("block", i)] for i in again if lo <= i <= hi), default=0)
                         for lo, hi in ranges), default=0)
        if config.selective:  # one attention core's scores at a time, during its recompute
            transient = max([transient] + ([scores.get(("block", i), 0) for lo, hi in ranges for i in range(lo, hi + 1)]
                                           if ranges else list(scores.values())))
        act = heaviest({**width, **kept})
        held, to_w = peaks[r] * act, 0
        if schedule == "zb_h1" and layout and pp > 1:  # what each microbatch keeps from its B until its W
            recomputed_in_w = activation_checkpointing and not zb_keep_recomputed
            to_w = act if r == 0 else (act if recomputed_in_w else heaviest(width)) + heaviest(w_grads)
            held = _zb_held(actions[r], r == 0, act, to_w)
            if zb_keep_recomputed and r > 0:
                transient = 0
        ks = layout.vstages_of(r) if layout else []
        sends = sum(message(k) for k in ks if k < layout.last_vstage) + \
            sum(message(k - 1, grad=True) for k in ks if k > 0)
        tp_elems = sum(n * w for loc, n in mine for _, w, phase in ops[loc])
        tp_again = sum(w for i in again for _, w, phase in ops[("block", i)] if phase == "fwd")
        for t in range(tp):
            if ranks is not None and (r, t) not in ranks:
                continue
            local = copy.deepcopy(base)  # split, then shard, as the strategy does (deepcopy drops param marks)
            if pp > 1:
                apply_split(local, layout, r)
            if tp > 1:
                swap.apply(local, matches, None, tp, t, sp)
            experts = _split_experts(local, config.ep, lookup.expert_styles(config.plan), config.etp, t % config.etp)
            params = list(local.parameters())
            trained = sum(p.numel() for p in params if p.requires_grad and id(p) not in experts)
            expert_trained = sum(p.numel() for p in params if p.requires_grad and id(p) in experts)
            partial = sum(p.numel() for p in params if p.requires_grad and marks_of(p).sp_partial)
            partial += sum(replica_buffer_numel(p) for p in params if p.requires_grad)
            tied = sum(p.numel() for p in params if p.requires_grad and marks_of(p).pp_tied)
            dp_costs = _fsdp_costs(local, params, config, acc, grad_bytes, state_bytes) \
                if config.zero == 3 and dp > 1 else \
                _dp_costs(params, experts if config.ep > 1 else set(), config, r, t, grad_bytes, state_bytes)
            rep.ranks.append(dataclasses.replace(RankEstimate(
                stage=r, tp_rank=t, params=sum(p.numel() for p in params),
                tp_bytes=round(tokens * (tp_elems + tp_again) * dtype_bytes) if tp > 1 else 0,
                tp_recompute_bytes=round(tokens * tp_again * dtype_bytes) if tp > 1 else 0,
                pp_bytes=round(tokens * sends * dtype_bytes),
                sp_bytes=partial * grad_bytes if tp > 1 else 0,
                tied_bytes=tied * grad_bytes if pp > 1 and r in tied_ranks else 0,
                dp_bytes=(trained + (expert_trained if config.ep == 1 else 0)) * grad_bytes if dp * cp > 1 else 0,
                cp_bytes=ring_bytes(base, lambda path, r=r: times(locate(path), r), config, B * T * acc,
                                    dtype_bytes) if cp > 1 else 0,
                expert_params=sum(p.numel() for p in params if id(p) in experts),
                ep_bytes=_all_to_all_bytes(base, config, r, locate, times, tokens, m * acc, dtype_bytes),
                edp_bytes=expert_trained * grad_bytes if config.ep > 1 and tp * dp * cp > config.ep * config.etp else 0,
                act_bytes=round((held + transient) * (B // m) * T * dtype_bytes), peak_microbatches=peaks[r],
                recompute_bytes=round(transient * (B // m) * T * dtype_bytes),
                zb_w_bytes=round(to_w * (B // m) * T * dtype_bytes)), **dp_costs))
    if cp > 1 and config.cp_attention == "ring":
        rep.cp_flop_per_byte = ring_flop_per_byte(base, config, T * cp, dtype_bytes)
    if print_report:
        print(rep)
    return rep


def _dp_costs(params: list, experts: set, config, pp_rank: int, tp_rank: int, grad_bytes: int,
              state_bytes: int) -> dict:
    """One rank's memory (dp rank 0's) and gradient collectives per step over dp and expert-dp, from the buckets
    the strategy's own DPOverlap (zero=0) or ShardedOptimizer (zero=1, one param group assumed) makes."""
    dp, gb = config.dp * config.cp, grad_bytes  # dp x cp: averaged
    edp = config.tp * config.cp * config.dp // (config.ep * config.etp)
    trained = [p for p in params if p.requires_grad]
    dense = [p for p in trained if id(p) not in experts]  # ``experts``: those ep > 1 splits, synced over expert-dp
    whole = sum(p.numel() for p in trained)
    held, ops, out, left, slots = whole, [], {}, [p for p in trained if id(p) in experts], 0
    if config.zero and dp > 1 and trained:
        for p in left:
            set_marks(p, expert=True)  # as the strategy marks them
        mesh = ParallelMesh(tp=config.tp, pp=config.pp, dp=dp, ep=config.ep, etp=config.etp,
                            rank=pp_rank * dp * config.tp + tp_rank)
        buckets = ShardedOptimizer(torch.optim.AdamW(trained), mesh).buckets
        held -= sum(q.numel() for b in buckets for q in b.params) - sum(b.size for b in buckets)
        slots = sum(b.flag_slots for b in buckets)  # the slices' gradients view the reduce-scatter's output: flags too
        for group, expert in (("dp", False), ("edp", True)):
            mine = [b for b in buckets if b.expert == expert]
            if mine:
                padded = sum(b.flat.numel() for b in mine) * gb  # each padded to a multiple of its group's size
                flags = sum(len(b.rows) * b.flag_slots for b in mine) * gb  # has-a-gradient flags, sent along
                ops += [("reduce_scatter", group, len(mine), padded + flags), ("all_gather", group, len(mine), padded)]
                out[f"{group}_bytes"] = 2 * padded
        bucketed = {id(q) for b in buckets for q in b.params}
        left = [p for p in left if id(p) not in bucketed]
    elif dp > 1 and dense:  # one all-reduce per bucket, with one flag per parameter (grads.with_flags)
        late = [p for p in dense if marks_of(p).pp_late_sync]
        calls = sum(len([b for b in DPOverlap(ps, None, dp, lambda: False, hooked=False).buckets if b])
                    for ps in ([p for p in dense if not marks_of(p).pp_late_sync], late) if ps)
        ops.append(("all_reduce", "dp", calls, (sum(p.numel() for p in dense) + len(dense)) * gb))
    if edp > 1 and left:  # experts kept whole: all-reduced over the ranks holding them, as grads.average_over_dp
        ops.append(("all_reduce", "edp", _chunk_count(left), (sum(p.numel() for p in left) + len(left)) * gb))
    return dict(out, weight_bytes=sum(p.numel() for p in params) * gb, grad_held_bytes=(held + slots) * gb,
                grad_whole_bytes=whole * gb, optim_state_bytes=held * state_bytes, dp_ops=ops)


def _fsdp_costs(local: nn.Module, params: list, config, acc: int, gb: int, state_bytes: int) -> dict:
    """zero=3 (FSDP2): dp rank 0's shards (ceil(rows / dp) of each tensor), and per step each unit's all-gather
    (a block's twice: forward and backward; the root's once) and reduce-scatter, padded to dp x a shard."""
    dp = config.dp
    blocks = [list(b.parameters()) for b in fsdp_blocks(local, block_places(config, local, None, 0))]
    in_blocks = {id(p) for b in blocks for p in b}
    root = [p for p in params if id(p) not in in_blocks]
    shard = lambda ps: sum(_rows_of(p, dp) for p in ps)  # noqa: E731
    whole = lambda ps: sum(p.numel() for p in ps)  # noqa: E731
    trained = lambda ps: [p for p in ps if p.requires_grad]  # noqa: E731
    units = [u for u in blocks + [root] if u]
    gathers = sum(dp * shard(u) for u in units) + sum(dp * shard(b) for b in blocks if b)
    scatters = [u for u in units if trained(u)]
    ops = [("all_gather", "dp", acc * (len(units) + len([b for b in blocks if b])), acc * gathers * gb),
           ("reduce_scatter", "dp", acc * len(scatters), acc * sum(dp * shard(trained(u)) for u in scatters) * gb)]
    biggest = max((whole(b) for b in blocks), default=0)
    return dict(weight_bytes=shard(params) * gb, grad_held_bytes=shard(trained(params)) * gb,
                grad_whole_bytes=(whole(trained(root)) + max((whole(trained(b)) for b in blocks), default=0)) * gb,
                optim_state_bytes=shard(trained(params)) * state_bytes,
                weight_gathered_bytes=(whole(root) + 2 * biggest) * gb,
                dp_bytes=ops[0][3] + ops[1][3], dp_ops=ops)


def _rows_of(p, dp: int) -> int:
    """Elements of ``p`` on dp rank 0 under FSDP2: ceil(rows / dp) rows (dim 0)."""
    if p.dim() == 0:
        return 1
    return -(-p.shape[0] // dp) * (p.numel() // max(1, p.shape[0]))


def _chunk_count(params: list) -> int:
    """How many flat buckets grads.average_over_dp makes of ``params`` (grads.chunked's rule)."""
    return sum(1 for _ in chunked(params))


def _split_experts(local: nn.Module, ep: int, declared=(), etp: int = 1, tp_rank: int = 0) -> set:
    """ids of ``local``'s expert parameters, after keeping 1/ep of each MoE layer's experts (ep > 1), and slice
    ``tp_rank`` of etp of each (etp > 1)."""
    found = set()
    for path, block, family in find_moe_blocks(local, declared):
        if family.fused:  # transformers 5.x: its experts module keeps its rank's block of each 3-D weight
            if ep > 1 or etp > 1:
                expert_parallel_experts(block.experts, None, ep, 0, tp_rank=tp_rank, etp_size=etp)
            found |= {id(p) for p in block.experts.parameters()}
            continue
        if ep > 1 or etp > 1:
            block = switch_parallel(block, None, ep, 0) if family is SWITCH else llama4_parallel(block, None, ep, 0) \
                if family is LLAMA4 else expert_parallel(block, family, None, ep, 0)
            if etp > 1:
                shard_experts(block.experts.values(), etp, tp_rank)
            local.set_submodule(path, block)
        found |= {id(p) for p in block.experts.parameters()}
    return found


def _all_to_all_bytes(base, config, r: int, locate, times, tokens: int, calls: int, dtype_bytes: int) -> int:
    """Bytes rank ``r`` hands to the dispatch all-to-alls per step: per MoE layer, k rows per token out and back,
    forward and backward (4 x tokens x k x hidden; balanced routing), and the counts; under tp 1/tp of the
    tokens (a sequence shard, or a share of the rows), under etp etp/tp of them (alike on the etp ranks)."""
    if config.ep == 1:
        return 0
    total, tokens = 0, tokens // (config.tp // config.etp)
    for path, block, family in find_moe_blocks(base, lookup.expert_styles(config.plan)):
        runs = times(locate(path), r)
        router = block.router.classifier if family is SWITCH else router_of(block)
        hidden = router.weight.shape[-1]
        total += runs * (4 * tokens * family.top_k(block) * hidden * dtype_bytes
                         + calls * family.num_experts(block) * 8)
    return total
