"""Random streams of the blocks under tp/pp: independent dropout masks where activations are split,
one stream per stage, and a default generator your code alone moves.
See docs/design/rng-and-recompute.md."""

from __future__ import annotations

import contextlib
import functools
import hashlib

import torch
from torch import nn

_PROBE_SEED = 0x5EED


def _mix(*parts) -> int:
    """A 63-bit seed from the parts (the same in every process, unlike ``hash``)."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


_BACKWARD = [0]  # depth of backward_pass(): a pipeline's backward actions


class _BackwardPass:
    """Around a pipeline's backward actions (B, W): a block's forward in there is a recomputation, also
    where ZB's weight half reads a saved tensor outside any autograd backward call (see pipeline.run.zb).
    A class, not a generator: it is entered on every gradient transfer's path."""

    def __enter__(self):
        _BACKWARD[0] += 1

    def __exit__(self, *exc):
        _BACKWARD[0] -= 1


def backward_pass() -> _BackwardPass:
    return _BACKWARD_PASS


_BACKWARD_PASS = _BackwardPass()


def _in_backward() -> bool:
    """A forward that runs inside autograd's backward (or a pipeline's backward actions) is a
    recomputation (checkpointing)."""
    return _BACKWARD[0] > 0 or torch._C._current_graph_task_id() != -1


class Generators:
    """The default generators a block's random ops draw from: the CPU's and the run's GPU's."""

    def __init__(self, device: torch.device):
        self.cuda = None
        if device.type == "cuda":
            self.cuda = device.index if device.index is not None else torch.cuda.current_device()

    def get(self):
        return torch.get_rng_state(), (torch.cuda.get_rng_state(self.cuda) if self.cuda is not None else None)

    def set(self, state) -> None:
        torch.set_rng_state(state[0])
        if self.cuda is not None:
            torch.cuda.set_rng_state(state[1], self.cuda)

    def seed(self, seed: int) -> None:
        torch.default_generator.manual_seed(seed)
        if self.cuda is not None:
            torch.cuda.default_generators[self.cuda].manual_seed(seed)

    def draw(self) -> int:
        """A number taken from the current streams, moving them on, without a device sync: the CPU
        stream's next value, mixed with the GPU stream's seed and position (moved on by one step)."""
        value = int(torch.randint(0, 1 << 62, (1,)))
        if self.cuda is not None:
            gen = torch.cuda.default_generators[self.cuda]
            offset = gen.get_offset()
            value = _mix(value, gen.initial_seed(), offset)
            gen.set_offset(offset + 4)  # philox offsets move in steps of 4
        return value

    def same(self, a, b) -> bool:
        return torch.equal(a[0], b[0]) and (a[1] is None or torch.equal(a[1], b[1]))


class _Frame:
    """One running block: the state to put back when it ends (``outer``: the default generators', if
    this frame swapped the block stream in; ``block``: the block stream's, while a shard stream is in),
    and for a recompute by a checkpoint we do not know, the probe state it started from."""

    __slots__ = ("name", "outer", "block", "probe")

    def __init__(self, name, outer=None, probe=None):
        self.name, self.outer, self.block, self.probe = name, outer, None, probe


class BlockStreams:
    """Hooks that run this rank's blocks on their own streams (see docs/design/rng-and-recompute.md)."""

    def __init__(self, seed: int, pp_rank: int, tp_rank: int, sp: bool, device: torch.device):
        self.gens = Generators(device)
        self.tp_rank, self.sp = tp_rank, sp
        outer = self.gens.get()
        self.gens.seed(_mix(seed, "block", pp_rank))
        self.block_state = self.gens.get()  # this rank's block stream, between its blocks
        self.gens.seed(_PROBE_SEED)
        self.probe_state = self.gens.get()
        self.gens.set(outer)
        self.frames: list = []
        self.handles: list = []
        self.pending = None  # a refusal torch silenced (raised in a hook while recomputing stopped early)

    def __deepcopy__(self, memo):
        return self  # a copy of the model (EMA, SWA) runs its blocks on the same streams

    def install(self, model: nn.Module, blocks: list, enters: list, leaves: list) -> None:
        """Hook the streams into this rank's ``blocks`` and the tp-split regions (``enters``, ``leaves``), and
        wrap ``model``'s Hugging Face checkpointing functions. See docs/design/rng-and-recompute.md."""
        for name, block in blocks:
            block._lightning_tp_streams = self
            self.handles.append(block.register_forward_pre_hook(functools.partial(self._enter_block, name)))
            self.handles.append(block.register_forward_hook(functools.partial(self._leave_block, name),
                                                            always_call=True))
        for m in model.modules():
            hf = m.__dict__.get("_gradient_checkpointing_func")
            if callable(hf) and not getattr(hf, "_lightning_tp_streams", False):
                m._gradient_checkpointing_func = self._around(hf)
        if self.sp:
            return  # the whole block is split (sequence shards, heads)
        for m, at_input in enters:  # bound methods, not lambdas: a model with hooks still pickles
            self.handles.append(m.register_forward_pre_hook(self._enter_shard) if at_input else
                                m.register_forward_hook(self._enter_shard))
        for m in leaves:
            self.handles.append(m.register_forward_pre_hook(self._leave_shard))

    # -------------------------------------------------------------- blocks

    def _around(self, checkpoint_fn):
        """Hugging Face's checkpointing function runs a block's call (its hooks inside) and replays it
        in backward: the block stream goes in around it, so the state it saves is the block's."""

        @functools.wraps(checkpoint_fn)
        def run(*args, **kwargs):
            if self.frames or _in_backward():
                return checkpoint_fn(*args, **kwargs)
            self.frames.append(_Frame("", outer=self._swap_in()))
            try:
                return checkpoint_fn(*args, **kwargs)
            finally:
                self._end(self.frames.pop())

        run._lightning_tp_streams = True
        return run

    @contextlib.contextmanager
    def recomputing(self, name: str):
        """Our checkpoint's recompute of a block (its hooks do not run again): a frame for its regions."""
        self.frames.append(_Frame(name))
        try:
            yield
        finally:
            self.frames.pop()  # the checkpoint puts the generators back itself

    def _swap_in(self):
        outer = self.gens.get()
        self.gens.set(self.block_state)
        return outer

    def raise_pending(self) -> None:
        """Raise a refusal made in a hook whose exception torch dropped: a non-reentrant checkpoint
        stops its recompute by raising once it has what backward needs, and an error in an
        ``always_call`` hook is then only warned about. Called after each backward, and by every block."""
        if self.pending is not None:
            message, self.pending = self.pending, None
            raise RuntimeError(message)

    def _enter_block(self, name, module, args):
        self.raise_pending()
        if not _in_backward():
            while self.frames and self.frames[-1].name is None:  # a region a recompute stopped inside
                self.frames.pop()
            # a block called inside a wrapped checkpoint (or another block) finds the stream in; its
            # recompute will find it restored
            module._lightning_tp_replayed = bool(self.frames)
            frame = _Frame(name) if self.frames else _Frame(name, outer=self._swap_in())
        elif getattr(module, "_lightning_tp_replayed", False) or self.frames:
            frame = _Frame(name)  # the checkpoint restored the block stream's state
        else:  # someone else's checkpoint restored the default stream: see whether the block draws
            frame = _Frame(name, outer=self.gens.get(), probe=True)
            self.gens.set(self.probe_state)
        self.frames.append(frame)
        if self.sp and frame.probe is None:
            self._enter_shard()

    def _leave_block(self, name, module, args, output):
        if self.frames and self.frames[-1].name == name:  # not if its pre-hook raised before pushing
            self._end(self.frames.pop())

    def _end(self, frame: _Frame) -> None:
        if frame.block is not None:  # a shard region still open
            self.gens.set(frame.block)
        if frame.probe:
            drew = not self.gens.same(self.gens.get(), self.probe_state)
            self.gens.set(frame.outer)
            if drew:
                self.pending = (
                    f"{frame.name} is recomputed by a checkpoint lightning_tp does not know (torch.utils."
                    f"checkpoint around the block's call in your code?) and draws random numbers (dropout). "
                    f"Under tp/pp blocks draw from their own streams, which that checkpoint does not replay: "
                    f"the recomputed masks would differ from the forward's. Use MegaStrategy("
                    f"activation_checkpointing=True) or Hugging Face's gradient_checkpointing_enable().")
                raise RuntimeError(self.pending)  # kept for raise_pending: torch may silence this one
        elif frame.outer is not None:
            self.block_state = self.gens.get()
            self.gens.set(frame.outer)

    # -------------------------------------------------------------- tp-split regions

    def _enter_shard(self, *hook_args) -> None:
        """One draw of the current (block) stream and the tp rank seed the shard stream. A checkpoint
        inside a block recomputes a region with no block frame around it (the block's hooks do not run
        again): the region gets a frame of its own (``name`` None), ended where the region ends."""
        if not self.frames:
            if not _in_backward():
                return  # a tp layer outside this rank's blocks
            self.frames.append(_Frame(None))
        frame = self.frames[-1]
        if frame.block is not None or frame.probe:
            return
        seed = _mix(self.gens.draw(), "shard", self.tp_rank)
        frame.block = self.gens.get()
        self.gens.seed(seed)

    def _leave_shard(self, *hook_args) -> None:
        if self.frames and self.frames[-1].block is not None:
            self.gens.set(self.frames[-1].block)
            self.frames[-1].block = None
            if self.frames[-1].name is None:
                self.frames.pop()
