"""Make the user's forward run one virtual stage at a time: this rank's blocks wrapped to take the received
activation and to stop at the next stage's first block (:class:`StageDone`). See
docs/design/pipeline-run.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..cut.block_lists import called_parts
from ..transport.messages import pack, unpack
from ..cut.placeholders import (ShapeOnly, SkippedBlock, handed_on, hidden_name, hidden_place, passthrough,
                           stand_in_output)
from ...tp_in_pp.sp_stages import shard_like


class StageDone(Exception):
    """Carries the output of this virtual stage's last block out of the user's step."""

    def __init__(self, output):
        super().__init__("pipeline stage finished")
        self.output = output


@dataclass
class StageRun:
    """One run of the user's step as virtual stage ``vstage``, set by the executor at its start; between
    runs the last one stays (its stage, whether its blocks began)."""

    vstage: int = 0
    activation: torch.Tensor | None = None  # received from the previous stage (None on the first)
    blocks_begun: bool = False  # the stage's first block has run (see ..cut.placeholders._check_place)
    called_before_blocks: set = field(default_factory=set)  # another stage's modules called here before them
    # an encoder-decoder: id(tensor the user's code computed) -> (it, the received part that replaces it)
    replaced: dict = field(default_factory=dict)
    passed_through: object = None  # the hidden states the last block outside the stage handed on (see _wrap)
    last_block_out: tuple | None = None  # (shape, dtype) of what the stage's last block call handed on
    activation_wait: object = None  # gloo: the wait for ``activation``'s values, made at the stage's first block
    send_at_stop: object = None  # gloo: the send of what the run hands on, made where it stops
    # values that travel behind the hidden states, along their last dimension (see StageMap.tail):
    carried: list = field(default_factory=list)  # those received (views of ``activation``)
    tail: list = field(default_factory=list)  # those this run hands on: the carried, then its own

    def stop(self, output) -> StageDone:
        """End the run here with ``output`` (and the ``tail`` behind it), sending it now (``send_at_stop``).
        See docs/design/pipeline-run.md."""
        if self.tail:
            output = with_tail(output, self.tail)
        send, self.send_at_stop = self.send_at_stop, None
        if send is not None:
            send(output)
        return StageDone(output)

    def wait_for_activation(self) -> None:
        """Wait for the received activation's values (once). See docs/design/pipeline-run.md."""
        wait, self.activation_wait = self.activation_wait, None
        if wait is not None:
            wait()


@dataclass
class StageMap:
    """This rank's virtual stages as :func:`install` set them, with the run in progress (``run``) and, while
    a backward recomputes blocks, its stage and activation (``replay``)."""

    ranges: list  # per virtual stage (first, last) block index
    last_vstage: int
    side_check: object = None  # one block list: the check of the blocks' other arguments (see .side_inputs)
    run_ends_at: dict = field(default_factory=dict)  # one block list: block index -> virtual stage ending there
    # an encoder-decoder under sp: the hidden states a stage receives inside a stack are sequence shards
    sp_shards: int = 1
    seq_dim: int = 1
    run: StageRun = field(default_factory=StageRun)
    replay: tuple | None = None  # while a backward runs: (virtual stage, its received activation)
    # virtual stage -> the widths of the values received behind its hidden states (router logits, see
    # ...experts.router_carry), or None: nothing travels but the hidden states
    tail: object = None


def with_tail(output: torch.Tensor, tail: list) -> torch.Tensor:
    """``output`` with the ``tail`` tensors (each shaped like it but for the last dimension) joined behind
    it along the last dimension, in its dtype; each takes a gradient where ``output`` does."""
    for t in tail:
        if t.shape[:-1] != output.shape[:-1]:
            raise ValueError(f"pipeline: a value that travels with the hidden states has shape {tuple(t.shape)}, "
                             f"the hidden states {tuple(output.shape)}: they must agree but for the last dimension.")
    grad = output.requires_grad
    return torch.cat([output] + [t.to(output.dtype) if t.requires_grad == grad else
                                 t.detach().to(output.dtype).requires_grad_(grad) for t in tail], dim=-1)


def hidden_of(received: torch.Tensor, widths: list, run: StageRun | None) -> torch.Tensor:
    """The hidden states of a received message with ``widths`` values behind them along the last dimension;
    those (views) become ``run``'s carried and tail, once a run (None: a backward's replay)."""
    if not widths:
        return received
    if run is not None:
        run.wait_for_activation()  # its shape is known once its values are in
    hidden = received.shape[-1] - sum(widths)
    if run is not None and not run.carried:
        run.carried = list(received[..., hidden:].split(widths, dim=-1))
        run.tail = list(run.carried)
    return received[..., :hidden]


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
                _wrap_chained(blocks[i], i, stage, i == layout.decoder_start, blocks.name(i), twins.get(i))
            else:
                _wrap(blocks[i], i, stage, twins.get(i), [(c[i], companion_twins.get((path, i))) for path, c in beside])
        if chained and k < layout.last_vstage:
            _stop_at(blocks[hi + 1], k, stage, hi + 1 == layout.decoder_start)
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


def _passthrough_of(twin, side_outputs: bool, name=None):
    """A block of this rank outside the running stage (another chunk's, under the interleaved schedule)
    passes its input through like a placeholder does, in the structure the block returns, worked out by
    its meta twin made before sharding (see ..cut.split.apply_split, ..cut.placeholders.passthrough)."""
    if twin is None:  # one chunk a rank: its blocks never run outside its stage
        return lambda args, kwargs: args[0] if args else kwargs[hidden_place(args, kwargs, name)]
    memo = {}
    return lambda args, kwargs: passthrough(twin, args, kwargs, side_outputs, memo)


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
    skip = _passthrough_of(twin, False, name)

    def forward(*args, **kwargs):
        run, replay = stage.run, stage.replay  # replay: a user's checkpoint recomputes it (in B or W, see executor)
        vstage, received = replay or (run.vstage, run.activation)
        span = stage.ranges[vstage]
        if _outside_stage(index, span):
            out = skip(args, kwargs)
            run.passed_through = handed_on(out)
            return out
        starts = _starts_stage(index, vstage, span)
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


def _outside_stage(index: int, span: tuple) -> bool:
    """The block lies outside the running stage's ``span`` (first, last): it passes its input through."""
    return not span[0] <= index <= span[1]


def _starts_stage(index: int, vstage: int, span: tuple) -> bool:
    """The block is the first of a stage that receives its input (any but virtual stage 0)."""
    return index == span[0] and vstage > 0


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


# ------------------------------------------------------------------------------ an encoder-decoder


def _carried(args, kwargs, list_start: bool, name=None) -> list:
    """Places (position or keyword) of the arguments that travel between an encoder-decoder's stages:
    floating-point positional tensors and encoder-output-like keyword ones. See docs/design/pipeline-run.md."""
    hidden = hidden_place(args, kwargs, name)
    like = _at(args, kwargs, hidden) if hidden is not None else None
    places = [i for i, a in enumerate(args) if _floating(a)]
    places += [k for k, a in kwargs.items() if _floating(a) and (k == hidden or (_shaped_like(a, like)
                                                                                 and "mask" not in k))]
    return [p for p in places if not (list_start and p == hidden)]


def _shaped_like(a: torch.Tensor, hidden) -> bool:
    return (isinstance(hidden, torch.Tensor) and a.dim() == hidden.dim() == 3
            and (a.shape[0] == hidden.shape[0] or a.shape[1] == hidden.shape[1]))


def _floating(a) -> bool:
    return isinstance(a, torch.Tensor) and a.is_floating_point()


def _at(args, kwargs, place):
    return args[place] if isinstance(place, int) else kwargs[place]


def _stand_in(value, run: StageRun):
    held = run.replaced.get(id(value)) if isinstance(value, torch.Tensor) else None
    return held[1] if held is not None and held[0] is value else value


def _wrap_chained(block, index: int, stage: StageMap, list_start: bool, name: str, twin=None) -> None:
    original = block.forward
    first = hidden_name(block)
    skip = _passthrough_of(twin, True, first)

    def forward(*args, **kwargs):
        if stage.replay is not None:
            raise ValueError(f"pipeline: {name} is recomputed in backward by a checkpoint of your own around its "
                             f"call; in an encoder-decoder pipeline use MegaStrategy(activation_checkpointing=True).")
        run = stage.run
        span = stage.ranges[run.vstage]
        if _outside_stage(index, span):
            return skip(args, kwargs)
        if _starts_stage(index, run.vstage, span):
            run.wait_for_activation()
            places = _carried(args, kwargs, list_start, first)
            computed = [_at(args, kwargs, p) for p in places]
            hidden = hidden_place(args, kwargs, first)
            like = [shard_like(c, stage.sp_shards, stage.seq_dim) if p == hidden and stage.sp_shards > 1 else c
                    for p, c in zip(places, computed)]  # this rank's shard of the sequence (see ...tp_in_pp.sp_stages)
            parts = unpack(run.activation, like)
            # later blocks are given the side inputs again (memory), never the first block's hidden states
            run.replaced = {id(c): (c, part) for p, c, part in zip(places, computed, parts) if p != hidden}
            received = dict(zip(places, parts))
            # by place: a tensor may be passed twice (src and tgt alike), only one place is received
            args = tuple(received.get(i, a) for i, a in enumerate(args))
            kwargs = {k: received.get(k, a) for k, a in kwargs.items()}
            return original(*args, **kwargs)
        if list_start:  # the decoder starts inside this stage: its memory is computed here
            run.replaced = {}
        elif run.vstage > 0 and torch.is_grad_enabled():
            _check_computed(args, kwargs, run, name, first)
        if run.replaced:
            args = tuple(_stand_in(a, run) for a in args)
            kwargs = {key: _stand_in(a, run) for key, a in kwargs.items()}
        return original(*args, **kwargs)

    block.forward = forward


def _check_computed(args, kwargs, run: StageRun, name: str, first=None) -> None:
    """A later block of a receiving stage may be given only what travelled (a stand-in) or what this
    stage computed (it requires grad): an encoder-output-like tensor that is neither was made by
    placeholders (decoder blocks given each their own encoder tensor, ``memory=mems[i]``)."""
    hidden = hidden_place(args, kwargs, first)
    for place in _carried(args, kwargs, False, first):
        a = _at(args, kwargs, place)
        if place != hidden and _shaped_like(a, _at(args, kwargs, hidden)) and not a.requires_grad \
                and id(a) not in run.replaced:
            raise ValueError(f"pipeline: {name} is given {place!r} (shape {tuple(a.shape)}), which is neither what "
                             f"its stage received nor computed there: each decoder block must be given the same "
                             f"encoder output as the stage's first. Use tp/dp for this model.")


def _stop_at(block, vstage: int, stage: StageMap, list_start: bool) -> None:
    """At the entry of virtual stage ``vstage + 1``'s first block, end ``vstage``'s run: what that block
    would be given (the encoder's output included) is the message."""
    original = block.forward
    first = hidden_name(getattr(block, "_twin", [block])[0])  # a placeholder here: its twin's

    def forward(*args, **kwargs):
        run = stage.run
        if run.vstage == vstage:
            places = _carried(args, kwargs, list_start, first)
            if not places:
                raise ValueError("pipeline: two block lists are taken as an encoder and a decoder, but the second "
                                 "list's first block is given no tensor besides its own input (the encoder's "
                                 "output). Name one block list: pipeline_blocks='path.to.blocks'.")
            raise run.stop(pack([_stand_in(_at(args, kwargs, p), run) for p in places]))
        return original(*args, **kwargs)

    block.forward = forward
