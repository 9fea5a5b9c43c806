"""A pipeline stage's state while the user's step runs: the run in progress (:class:`StageRun`), this rank's
virtual stages (:class:`StageMap`), values carried behind the hidden states, and where a block stands
against the running stage. See docs/design/pipeline-run.md."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..cut.placeholders import hidden_place, passthrough


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
    # ...experts.router_losses.carry), or None: nothing travels but the hidden states
    tail: object = None
    tail_stacks: object = None  # an encoder-decoder's: virtual stage -> the stack ("encoder"/"decoder") of each
    decoder_start: object = None  # the decoder's first chain index (with tail_stacks)
    # this rank's device: where a placeholder's stand-ins go when its inputs sit on meta (a model that moved them
    # to its embedding's weight's device, which another stage holds: Llama 4)
    device: object = None


def with_tail(output: torch.Tensor, tail: list) -> torch.Tensor:
    """``output`` with the ``tail`` tensors behind it: along its last dimension, or flat behind an encoder-decoder's
    packed message (a 1-d one, see ..transport.messages.pack)."""
    if output.dim() > 1:
        return _joined(output, tail)
    grad = output.requires_grad
    flat = [(t if t.requires_grad == grad else t.detach().requires_grad_(grad)).to(output.dtype).reshape(-1)
            for t in tail]
    split = getattr(output, "_lightning_tp_grad_split", None)
    if split is None:
        return torch.cat([output] + flat)
    parts, numel = split  # the parts that take a gradient lead the message: the tail joins them
    message = torch.cat([output[:numel]] + flat + [output[numel:]])
    message._lightning_tp_grad_split = (parts, numel + sum(t.numel() for t in flat))
    return message


def _joined(output: torch.Tensor, tail: list) -> torch.Tensor:
    """``output`` with the ``tail`` tensors (each shaped like it but for the last dimension) joined behind
    it along the last dimension, in its dtype; each takes a gradient where ``output`` does."""
    for t in tail:
        if t.shape[:-1] != output.shape[:-1]:
            raise ValueError(f"pipeline: a value that travels with the hidden states has shape {tuple(t.shape)}, "
                             f"the hidden states {tuple(output.shape)}: they must agree but for the last dimension.")
    grad = output.requires_grad
    return torch.cat([output] + [t.to(output.dtype) if t.requires_grad == grad else
                                 t.detach().to(output.dtype).requires_grad_(grad) for t in tail], dim=-1)


def packed_of(received: torch.Tensor, like: list, widths: list, leads: list, run: StageRun) -> torch.Tensor:
    """An encoder-decoder's packed message less the values behind it (``widths`` each, shaped ``leads``), which
    (views) become ``run``'s carried and tail."""
    run.wait_for_activation()
    if received.dim() > 1:  # one part: the values along its last dimension, as a block list's
        return hidden_of(received, widths, run)
    whole, parts = getattr(received, "_lightning_tp_whole", (received, 0))  # a grad split (see ..transport.messages)
    head = sum(t.numel() for i, t in enumerate(like) if not parts or parts >> i & 1)
    sizes = [math.prod(lead) * w for lead, w in zip(leads, widths)]
    if whole.numel() != sum(t.numel() for t in like) + sum(sizes):
        raise ValueError(f"pipeline: received {whole.numel()} values for tensors of shapes "
                         f"{[tuple(t.shape) for t in like]} and router logits {list(zip(leads, widths))}.")
    if not run.carried:
        run.carried = [p.view(*lead, w) for p, lead, w in zip(received[head:].split(sizes), leads, widths)]
        run.tail = list(run.carried)
    message = received[:head]
    if parts:
        message._lightning_tp_whole = (torch.cat([whole[:head], whole[head + sum(sizes):]]), parts)
    return message


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


def passthrough_of(twin, side_outputs: bool, name=None):
    """A block of this rank outside the running stage (another chunk's, under the interleaved schedule)
    passes its input through like a placeholder does, in the structure the block returns, worked out by
    its meta twin made before sharding (see ..cut.split.apply_split, ..cut.placeholders.passthrough)."""
    if twin is None:  # one chunk a rank: its blocks never run outside its stage
        return lambda args, kwargs: args[0] if args else kwargs[hidden_place(args, kwargs, name)]
    memo = {}
    return lambda args, kwargs: passthrough(twin, args, kwargs, side_outputs, memo)


def outside_stage(index: int, span: tuple) -> bool:
    """The block lies outside the running stage's ``span`` (first, last): it passes its input through."""
    return not span[0] <= index <= span[1]


def starts_stage(index: int, vstage: int, span: tuple) -> bool:
    """The block is the first of a stage that receives its input (any but virtual stage 0)."""
    return index == span[0] and vstage > 0
