"""Make the user's forward run one virtual stage at a time: this rank's blocks wrapped to take the received
activation and to stop at the next stage's first block (``StageDone``, see .stage_state; an encoder-decoder's
blocks: .stage_chained). See docs/design/pipeline-run.md."""

from __future__ import annotations

import torch

from ..cut.block_lists import called_parts
from ..cut.placeholders import ShapeOnly, SkippedBlock, handed_on, hidden_name, hidden_place, stand_in_output
from .stage_chained import stop_at, wrap_chained
from .stage_state import StageMap, StageRun, hidden_of, outside_stage, passthrough_of, starts_stage


def install(blocks, layout, pp_rank: int, silence=(), twins=None, side=None, companion_twins=None) -> StageMap:
    """Wrap this rank's blocks (and ``silence`` the modules its other chunks must not rerun) for their virtual
    stages; returns the :class:`StageMap`. Arguments: docs/design/pipeline-run.md."""
    twins, companion_twins = twins or {}, companion_twins or {}
    beside = [(c, blocks.model.get_submodule(c)) for c in layout.companions]
    stage = StageMap(layout.ranges, layout.last_vstage)
    chained = layout.decoder_start is not None
    for k in layout.vstages_of(pp_rank):
        lo, hi = layout.ranges[k]
        for i in range(lo, hi + 1):
            if chained:
                wrap_chained(blocks[i], i, stage, i == layout.decoder_start, blocks.name(i), twins.get(i))
            else:
                _wrap(blocks[i], i, stage, twins.get(i), [(c[i], companion_twins.get((path, i))) for path, c in beside])
        if chained and k < layout.last_vstage:
            stop_at(blocks[hi + 1], k, stage, hi + 1 == layout.decoder_start)
    for module, twin, runs in silence:
        _silence_outside(module, twin, runs, stage)
    if not chained:  # an encoder-decoder's modules have their own places (see StageLayout.runs), and
        stage.side_check = side  # its side inputs travel
        stage.run_ends_at = {layout.ranges[k][1] + 1: k for k in layout.vstages_of(pp_rank) if k < layout.last_vstage}
        for m in blocks.model.modules():
            if isinstance(m, ShapeOnly):
                m.stage = stage
        for i in range(len(blocks)):  # a block, the pieces of one called piece by piece, and those beside it
            for piece in [m for module in [blocks[i]] + [c[i] for _, c in beside] for m in module.modules()]:
                if isinstance(piece, SkippedBlock):
                    piece.stage, piece.index = stage, i
    return stage


def _silence_outside(module, twin, runs: set, stage: StageMap) -> None:
    """An embedding only feeds virtual stage 0 (and an encoder-decoder's decoder stage): in another
    chunk's run it returns stand-ins of its shape (see ..cut.placeholders.stand_in_output)."""
    original = module.forward

    def forward(*args, **kwargs):
        if stage.run.vstage not in runs:
            return stand_in_output(twin, args, kwargs)
        return original(*args, **kwargs)

    module.forward = forward


def _wrap(block, index: int, stage: StageMap, twin=None, beside=()) -> None:
    """Wrap a block to take the stage's activation: at its call, or for one called piece by piece (or with
    ``beside`` modules) at the first piece given hidden states. See docs/design/pipeline-run.md."""
    parts = called_parts(block)
    if parts == [("", block)] and not beside:
        _wrap_call(block, index, stage, twin, None)
        return
    twins = dict(called_parts(twin)) if twin is not None else {}
    entry = {}
    for path, piece in parts:
        _wrap_call(piece, index, stage, twins.get(path), entry)
    for module, module_twin in beside:
        for path, piece in called_parts(module):
            _wrap_call(piece, index, stage, dict(called_parts(module_twin)).get(path) if module_twin is not None else None, entry)


def _wrap_call(block, index: int, stage: StageMap, twin, entry) -> None:
    original = block.forward
    name = hidden_name(block)
    skip = passthrough_of(twin, False, name)

    def forward(*args, **kwargs):
        run, replay = stage.run, stage.replay  # replay: a user's checkpoint recomputes it (in B or W, see executor)
        vstage, received = replay or (run.vstage, run.activation)
        span = stage.ranges[vstage]
        if outside_stage(index, span):
            out = skip(args, kwargs)
            run.passed_through = handed_on(out)
            return out
        starts = starts_stage(index, vstage, span)
        if starts and stage.tail is not None and received is not None:
            received = hidden_of(received, stage.tail(vstage), run if replay is None else None)
        if starts and entry is not None and replay is None and not run.blocks_begun \
                and _like(args[0] if args else kwargs.get(hidden_place(args, kwargs, name)), received):
            entry["piece"] = block  # the first piece given hidden states (not a norm's mod(condition))
        takes = starts and _takes_received_activation(block, entry)
        if takes or not starts:  # not a piece called before the one that takes it
            run.blocks_begun = True
        if takes:
            args, kwargs = _given_activation(args, kwargs, name, run, received, replay is not None, index, vstage)
        hands_on = _hands_on_here(index, vstage, span, stage.last_vstage, replay)
        if hands_on and stage.side_check is not None:
            stage.side_check.leave(vstage, index, args, kwargs, hidden_place(args, kwargs, name))
        out = original(*args, **kwargs)
        if hands_on:
            _check_side_inputs(args, kwargs, name, index)
        _note_output(run, out)
        return out

    block.forward = forward


def _takes_received_activation(block, entry) -> bool:
    """This call of a stage's first block takes the received activation: the block's own call, or of one
    called piece by piece (``entry``) the piece found given hidden states."""
    return entry is None or entry.get("piece") is block


def _hands_on_here(index: int, vstage: int, span: tuple, last_vstage: int, replay) -> bool:
    """The block is the last of a stage that hands its output on, in a forward run (not a backward's replay)."""
    return index == span[1] and vstage < last_vstage and replay is None


def _given_activation(args, kwargs, name, run, received, replaying: bool, index: int, vstage: int):
    """The block's arguments with the received activation as its hidden states: written into the user's tensor
    where that may take it (see _takes_in_place), else in the argument's place. See docs/design/pipeline-run.md."""
    run.wait_for_activation()
    place = hidden_place(args, kwargs, name)
    computed = args[0] if args else kwargs.get(place)
    # what the previous (skipped) block handed on, unchanged (h = block(h)): only the argument
    # changes; else code between the blocks made it (h = h + block(h)) and it takes the activation
    taken = not replaying and computed is not run.passed_through and _takes_in_place(computed, received)
    if taken and _in_users_checkpoint():
        raise ValueError(
            f"pipeline: block {index} begins virtual stage {vstage} and is called under a checkpoint "
            f"of your own (torch.utils.checkpoint) after code between the blocks (h = h + block(h), "
            f"F.relu(block(h))): the received activation must become your variable, which cannot be "
            f"written inside that checkpoint. Use MegaStrategy(activation_checkpointing=True) instead, "
            f"or checkpoint inside the block.")
    if taken and _written(computed, received):  # the user's variable holds it too
        return args, kwargs
    return ((received,) + tuple(args[1:]), kwargs) if args else (args, {**kwargs, place: received})


def _note_output(run: StageRun, out) -> None:
    """Keep the (shape, dtype) of the hidden states a stage's block call returned (see SkippedBlock.piece)."""
    hidden = out if isinstance(out, torch.Tensor) else out[0] if isinstance(out, (tuple, list)) and out else None
    if isinstance(hidden, torch.Tensor):
        run.last_block_out = (tuple(hidden.shape), hidden.dtype)


def _like(value, received) -> bool:
    return isinstance(value, torch.Tensor) and isinstance(received, torch.Tensor) and \
        value.shape == received.shape and value.dtype == received.dtype


def _in_users_checkpoint() -> bool:
    """Inside a non-reentrant ``torch.utils.checkpoint`` (its saved-tensor hooks), which refuses a
    change in place of its input at the backward."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return hooks is not None and "_checkpoint_hook" in getattr(hooks[0], "__qualname__", "")


def _takes_in_place(computed, received) -> bool:
    """Whether the tensor the user's code hands the stage's first block may take the received activation in
    place (not a placeholder's output, a batch tensor, a view of one, a leaf). See
    docs/design/pipeline-run.md."""
    if not (isinstance(computed, torch.Tensor) and isinstance(received, torch.Tensor)
            and computed.shape == received.shape and computed.dtype == received.dtype
            and computed.device == received.device):
        return False
    base = computed._base if computed._is_view() else None
    return not any(t is not None and (getattr(t, "_lightning_tp_placeholder", False) or (t.requires_grad and t.is_leaf))
                   for t in (computed, base))


def _written(computed, received) -> bool:
    """Write the received activation into the user's tensor, its history cut first; False where that cannot be
    done (the caller then replaces the block's argument alone). See docs/design/pipeline-run.md."""
    if computed._is_view():
        if computed.requires_grad:
            return False
    elif computed.grad_fn is not None:
        computed.detach_()
    try:
        computed.copy_(received)
    except torch.OutOfMemoryError:
        raise
    except RuntimeError:
        return False
    return True


def _check_side_inputs(args, kwargs, name, index: int) -> None:
    """Refuse a block argument besides the hidden states that is computed from trainable weights: it cannot
    travel, and the next stage would make it from stand-ins. See docs/design/pipeline-run.md."""
    hidden = hidden_place(args, kwargs, name)
    extra = [(i, a) for i, a in enumerate(args) if i != hidden] + [(k, a) for k, a in kwargs.items() if k != hidden]
    for place, a in extra:
        if isinstance(a, torch.Tensor) and a.requires_grad and not isinstance(a, torch.nn.Parameter):
            what = f"argument {place}" if isinstance(place, int) else repr(place)
            raise ValueError(f"pipeline: block {index} is given {what} (shape {tuple(a.shape)}) besides its hidden "
                             f"states, computed from trainable weights outside the blocks; only the hidden states "
                             f"travel between stages, so the next stage would not have it (it would compute it "
                             f"from placeholders' stand-ins, and its gradient would not reach those weights). Use "
                             f"tp/dp for this model, or derive it inside the blocks.")


