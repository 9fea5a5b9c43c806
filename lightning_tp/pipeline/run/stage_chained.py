"""An encoder-decoder's blocks under a pipeline: what travels between its stages (the hidden states and
the encoder's output, packed as one message), the stage's first block given it, and the run stopped at the
next stage's first block. See docs/design/pipeline-run.md."""

from __future__ import annotations

import torch

from ..cut.placeholders import hidden_name, hidden_place
from ..transport.messages import pack, unpack
from ...tp_in_pp.sp_stages import shard_like
from .stage_state import StageMap, StageRun, outside_stage, packed_of, passthrough_of, starts_stage


def carried_places(args, kwargs, list_start: bool, name=None) -> list:
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


def wrap_chained(block, index: int, stage: StageMap, list_start: bool, name: str, twin=None) -> None:
    original = block.forward
    first = hidden_name(block)
    skip = passthrough_of(twin, True, first)

    def forward(*args, **kwargs):
        if stage.replay is not None:
            raise ValueError(f"pipeline: {name} is recomputed in backward by a checkpoint of your own around its "
                             f"call; in an encoder-decoder pipeline use MegaStrategy(activation_checkpointing=True).")
        run = stage.run
        span = stage.ranges[run.vstage]
        if outside_stage(index, span):
            return skip(args, kwargs)
        if starts_stage(index, run.vstage, span):
            run.wait_for_activation()
            places = carried_places(args, kwargs, list_start, first)
            computed = [_at(args, kwargs, p) for p in places]
            hidden = hidden_place(args, kwargs, first)
            like = [shard_like(c, stage.sp_shards, stage.seq_dim) if p == hidden and stage.sp_shards > 1 else c
                    for p, c in zip(places, computed)]  # this rank's shard of the sequence (see ...tp_in_pp.sp_stages)
            message = run.activation
            if stage.tail_stacks is not None and stage.tail(run.vstage):  # router logits behind the message
                leads = _leads(stage.tail_stacks(run.vstage), like, places, hidden, index < stage.decoder_start,
                               stage.sp_shards, stage.seq_dim)
                message = packed_of(message, like, stage.tail(run.vstage), leads, run)
            parts = unpack(message, like)
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


def _leads(stacks: list, like: list, places: list, hidden, in_encoder: bool, sp_shards: int = 1, seq_dim: int = 1) -> list:
    """The leading shape of each carried router logit: its stack's hidden states' (the encoder's: the hidden
    states inside the encoder, else the encoder's output among the message's parts), a sequence shard under sp."""
    own = like[places.index(hidden)].shape[:-1] if hidden in places else None
    memory = next((t.shape[:-1] for p, t in zip(places, like) if p != hidden and t.dim() == 3), own)
    encoder = list(own if in_encoder else memory)
    if not in_encoder and sp_shards > 1:  # the encoder's output travels whole, its layers' logits as shards
        encoder[seq_dim] //= sp_shards
    return [tuple(encoder if s == "encoder" else own) for s in stacks]


def _check_computed(args, kwargs, run: StageRun, name: str, first=None) -> None:
    """A later block of a receiving stage may be given only what travelled (a stand-in) or what this
    stage computed (it requires grad): an encoder-output-like tensor that is neither was made by
    placeholders (decoder blocks given each their own encoder tensor, ``memory=mems[i]``)."""
    hidden = hidden_place(args, kwargs, first)
    for place in carried_places(args, kwargs, False, first):
        a = _at(args, kwargs, place)
        if place != hidden and _shaped_like(a, _at(args, kwargs, hidden)) and not a.requires_grad \
                and id(a) not in run.replaced:
            raise ValueError(f"pipeline: {name} is given {place!r} (shape {tuple(a.shape)}), which is neither what "
                             f"its stage received nor computed there: each decoder block must be given the same "
                             f"encoder output as the stage's first. Use tp/dp for this model.")


def stop_at(block, vstage: int, stage: StageMap, list_start: bool) -> None:
    """At the entry of virtual stage ``vstage + 1``'s first block, end ``vstage``'s run: what that block
    would be given (the encoder's output included) is the message."""
    original = block.forward
    first = hidden_name(getattr(block, "_twin", [block])[0])  # a placeholder here: its twin's

    def forward(*args, **kwargs):
        run = stage.run
        if run.vstage == vstage:
            places = carried_places(args, kwargs, list_start, first)
            if not places:
                raise ValueError("pipeline: two block lists are taken as an encoder and a decoder, but the second "
                                 "list's first block is given no tensor besides its own input (the encoder's "
                                 "output). Name one block list: pipeline_blocks='path.to.blocks'.")
            raise run.stop(pack([_stand_in(_at(args, kwargs, p), run) for p in places]))
        return original(*args, **kwargs)

    block.forward = forward
